"""Datastores: corpus positions the drafters retrieve from.

`format.py` holds what every kind shares (manifest, fingerprints, atomic resumable builds);
`dense.py` is DReSD's (hidden-state keys, `transform.py`, `index.py`).
"""
