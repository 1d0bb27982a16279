"""Training-state transfer to joining or restarted members (issue #5 item 2).

* :mod:`dreamp2p.statemeta` — what a donor announces (tensor metadata, manifest) and its limits; torch-free.
* :mod:`dreamp2p.state.snapshot` — pure encoding: nested state <-> JSON skeleton + raw, hashed tensor bytes.
* :mod:`dreamp2p.state.donor` — serves snapshots of a live node's state (captured between training steps).
* :mod:`dreamp2p.state.fetch` — pulls a state from one or several donors, hash-verified, switching donors.

Nothing here ever unpickles peer data: tensors cross the wire as raw bytes plus validated metadata.
"""
