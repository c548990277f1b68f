"""Datastores that retrieval drafters search: sparse.py (suffix array, for REST)."""
