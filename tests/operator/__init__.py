"""Tests of the operator, with the API emulator's validation and server-side apply."""
