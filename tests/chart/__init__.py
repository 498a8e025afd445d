"""Tests of the Helm chart, rendered by helm."""
