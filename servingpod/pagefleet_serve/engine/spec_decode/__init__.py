"""Speculative decoding: proposers, verification of their drafts, acceptance counters."""
