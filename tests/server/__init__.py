"""Tests of the serving pod's HTTP server, with the server harness shared by other folders."""
