"""`bench lm` variants may set the node's comm path (``dreamddp:comm=process``) beside SyncConfig keys."""

from __future__ import annotations

import pytest

from dreamp2p.devtools.bench.lm.run import bench_lm, parse_variant, split_node_keys


def test_comm_key_goes_to_the_node_config() -> None:
    strategy, own = parse_variant("dreamddp:comm=process,max_delay=3")
    assert strategy == "dreamddp"
    assert split_node_keys(own) == ({"max_delay": 3}, {"comm": "process"})


def test_a_bad_comm_mode_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="comm must be one of thread, process; got 'fork'"):
        bench_lm(strategies=["dreamddp:comm=fork"], steps=1)
