"""`pagefleet router`: a prefix- and load-aware proxy for the OpenAI routes in front of an
InferenceService's pods. Imports neither torch nor `pagefleet_serve`: it ships in the
operator's torch-free image."""
