"""Datastores: corpus positions the drafters retrieve from.

`format.py` holds what every kind shares (manifest, compatibility check, atomic resumable
builds; the fingerprints it compares are `dresd/fingerprint.py`);
`dense.py` is DReSD's (hidden-state keys, `transform.py`, `index.py`); `sparse.py` is REST's
(a suffix array over the token ids), `sparse_store.py` builds and opens it as a datastore.
"""
