"""The pieces of tensor parallelism that need no group: the control channel's wire format,
the sharding checks, the CLI's refusals."""

from __future__ import annotations

import dataclasses
import re
import socket

import numpy as np
import pytest
from mlx_lm.models import gemma, llama

from mlxserve.mlx_backend.distributed import wire
from mlxserve.mlx_backend.distributed.executor import smallest_plan
from mlxserve.mlx_backend.distributed.sharding import (
    ShardingError,
    check_shardable,
    pipeline_module,
)
from mlxserve.scheduler.memory_plan import MemoryPlan, PoolRequest
from mlxserve.server.cli import main
from tests.tensor_parallel_server import sample_batch


def _through_socket(frame: bytes) -> wire.Message:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        return wire.recv(b)


class TestWireFormat:
    @pytest.mark.parametrize("embed", [False, True])
    def test_batch_round_trip(self, embed):
        sent = sample_batch(embed)
        msg = _through_socket(wire.encode(wire.Kind.FORWARD, wire.encode_batch(sent)))
        got = wire.decode_batch(msg.arrays)
        assert msg.kind == wire.Kind.FORWARD
        assert got.phase == sent.phase
        for name in ("input_ids", "write_slots", "read_slots", "fresh_rows", "state_copies_in"):
            want = getattr(sent, name)
            have = getattr(got, name)
            assert have.dtype == want.dtype and np.array_equal(have, want), name
        assert [g.tolist() for g in got.row_groups] == [[0, 2], [1]], got.row_groups
        assert (got.embed_rows is None) == (not embed), got.embed_rows
        assert got.spec_lens is None, "no proposals were sent"
        assert np.all(got.sampling.temperature == 0), "workers run greedy (they sample nothing)"

    def test_proposals_travel(self):
        """Rows with proposals run packed on every rank: the workers must know them, or
        their forward's shapes (and so the collectives) would differ from rank 0's."""
        sent = dataclasses.replace(sample_batch(False), spec_lens=np.array([2, 0, 1], np.int32))
        got = wire.decode_batch(wire.encode_batch(sent))
        assert got.spec_lens is not None and got.spec_lens.tolist() == [2, 0, 1], got.spec_lens

    def test_plan_and_pool_request_round_trip(self):
        for plan in (MemoryPlan(512, 64, 8, 4, 12345), MemoryPlan(512, 0, None, 0, 9, True)):
            assert wire.decode_plan(wire.encode_plan(plan)) == plan
        for request in (
            PoolRequest(0, 32, 2048, 0.25, 4096, True, 10**9),
            PoolRequest(0, 32, 2048, 0.25, 4096, True, 10**9, kv_bits=4, kv_group_size=32),
        ):
            got = wire.decode_pool_request(wire.encode_pool_request(request))
            assert got == request, "every rank quantizes its pools alike"

    def test_a_foreign_frame_is_refused(self):
        with pytest.raises(wire.WireError, match="magic"):
            _through_socket(b"GET / HTTP/1.1\r\n\r\n")

    def test_a_truncated_array_is_refused(self):
        frame = wire.encode(wire.Kind.FORWARD, [np.arange(8, dtype=np.int64)])
        payload = frame[wire._HEADER.size :]
        with pytest.raises(wire.WireError, match="runs past"):
            wire.decode_arrays(payload[:-8], 1)

    def test_objects_cannot_be_sent(self):
        with pytest.raises(wire.WireError, match="cannot be sent"):
            wire.encode(wire.Kind.FORWARD, [np.array(["text"], dtype=object)])

    def test_a_closed_peer_is_reported(self):
        a, b = socket.socketpair()
        a.close()
        with b, pytest.raises(wire.PeerClosed):
            wire.recv(b)


def _llama(heads: int, kv_heads: int, mlp: int = 128) -> llama.Model:
    return llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=1,
            intermediate_size=mlp,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=32,
        )
    )


class TestShardingChecks:
    def test_divisible_model_passes(self):
        check_shardable(_llama(4, 2), 2)

    @pytest.mark.parametrize(
        ("model", "ranks", "width"),
        [
            (lambda: _llama(4, 1), 2, "KV heads (1)"),
            (lambda: _llama(4, 4), 3, "attention heads (4)"),
            (lambda: _llama(4, 2, mlp=129), 2, "MLP width (129)"),
        ],
    )
    def test_indivisible_width_is_named(self, model, ranks, width):
        expected = re.escape(f"llama over {ranks} ranks: its {width}")
        with pytest.raises(ShardingError, match=expected):
            check_shardable(model(), ranks)

    def test_model_without_shard_is_refused_by_name(self):
        args = gemma.ModelArgs(
            model_type="gemma",
            hidden_size=64,
            num_hidden_layers=1,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            rms_norm_eps=1e-6,
            vocab_size=32,
            num_key_value_heads=2,
        )
        with pytest.raises(ShardingError, match="'gemma' has no tensor-parallel shard"):
            check_shardable(gemma.Model(args), 2)


class TestPipelineChecks:
    def test_model_without_pipeline_is_refused_by_name(self):
        with pytest.raises(ShardingError, match="'llama' has no pipeline"):
            pipeline_module(_llama(4, 2))


class TestSmallestPlan:
    def test_each_kind_takes_the_fewest_slots_of_the_ranks_holding_it(self):
        # Pipeline ranks may hold different kinds of layers: a rank without recurrent
        # layers (0 state slots) must not take the others' state slots away.
        plans = [MemoryPlan(512, 0, None, 0, 10), MemoryPlan(300, 64, 8, 16, 20)]
        assert smallest_plan(plans) == MemoryPlan(300, 64, 8, 16, 20)
        assert smallest_plan([MemoryPlan(512), MemoryPlan(400)]).full_tokens == 400


class TestCliRefusals:
    @pytest.mark.parametrize(
        "argv",
        [
            ["--tensor-parallel", "2", "--model", "a", "--model", "b"],
            ["--tensor-parallel", "0"],
            ["--tensor-parallel", "2", "--distributed-backend", "jaccl"],
            ["--tensor-parallel", "2", "--pipeline-parallel", "2"],
        ],
    )
    def test_bad_combinations_are_usage_errors(self, argv, capsys):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, capsys.readouterr().err
