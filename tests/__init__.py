"""The test suite, one package per part of the stack; helpers are imported by their package
path (`from tests.server.server_harness import ServerProcess`)."""
