"""Tests of the benchmark clients and reports."""
