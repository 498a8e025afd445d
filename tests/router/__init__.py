"""Tests of the router: its policy, its proxy and its discovery."""
