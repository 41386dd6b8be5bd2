"""Attention over the slot pools: the dispatch point and the native ragged op."""
