"""Tests of the engine, the model loaders and the built-in models."""
