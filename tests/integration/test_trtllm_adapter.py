# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM adapter on CPU: settings checks, the block-offset encoding, and
VTokenKVCacheManager driven over the 1.2.1 doubles (``trtllm121/``) through prefill and decode
iterations for every policy, with I1/I2/I4 checked on every relocation, and its published
counters. (Attention mass: test_trtllm_scores.py; start-up route: test_trtllm_startup.py;
metadata: test_trtllm_metadata.py; parallel layouts: test_trtllm_parallel.py.)"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from tests.integration.trtllm_doubles import (
    CacheType,
    DataType,
    KvCacheConfig,
    KVCacheManager,
    KVCacheParams,
    Mapping,
    ScheduledRequests,
    TrtllmAttentionMetadata,
    make_request,
)
from trtllm_vtoken.integration.trtllm import llm_args_dict
from trtllm_vtoken.integration.trtllm.manager import build_manager_class
from trtllm_vtoken.integration.trtllm.metadata import build_metadata_class
from trtllm_vtoken.integration.trtllm.offsets import decode, encode, write_row
from trtllm_vtoken.integration.trtllm.settings import ENV_VAR, VTokenSettings, check_llm_args
from trtllm_vtoken.integration.trtllm.stats import StatsFile, read_stats
from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.serving.metrics import METRICS

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
TPB, LAYERS, KV_HEADS, HEADS, DIM = 4, 2, 2, 4, 8
POLICY_OPTIONS = {"streaming_llm": {"n_sink": 2}}


# ---- settings ---------------------------------------------------------------------------------------
def test_settings_travel_through_the_environment():
    chosen = VTokenSettings(policy="streaming_llm", budget=24, policy_options={"n_sink": 2})
    assert VTokenSettings.from_env(chosen.worker_environment()) == chosen
    assert chosen.worker_environment() == {"VTOKEN_TRTLLM": "1", ENV_VAR: chosen.to_env()}
    with pytest.raises(ValueError, match="not valid JSON"):
        VTokenSettings.from_env({ENV_VAR: "{policy"})
    with pytest.raises(ValueError, match=r"unknown VTokenSettings key\(s\) \['polcy'\]"):
        VTokenSettings.from_env({ENV_VAR: json.dumps({"polcy": "h2o"})})
    with pytest.raises(ValueError, match="mode 'dense' only"):
        VTokenSettings(mode="lazy")
    with pytest.raises(KeyError, match="nope"):
        VTokenSettings(policy="nope")


def test_missing_settings_are_an_error_never_defaults():
    """Armed (or a manager built) without settings: a clear error naming both variables."""
    with pytest.raises(RuntimeError, match=r"vToken is armed \(\$VTOKEN_TRTLLM=1\) in process \d+ but \$VTOKEN_TRTLLM_SETTINGS is not set"):
        VTokenSettings.from_env({"VTOKEN_TRTLLM": "1"})
    with pytest.raises(RuntimeError, match="VTOKEN_TRTLLM_SETTINGS is not set"):
        VTokenSettings.from_env({})
    cls = build_manager_class(KVCacheManager)
    with pytest.raises(RuntimeError, match="VTOKEN_TRTLLM_SETTINGS is not set"):
        cls(KvCacheConfig(enable_block_reuse=False), CacheType.SELF, num_layers=1, num_kv_heads=1, head_dim=2,
            tokens_per_block=4, max_seq_len=8, max_batch_size=1, mapping=Mapping())


def test_required_llm_settings_are_checked_all_at_once():
    check_llm_args(llm_args_dict())  # what vtoken_llm_args returns passes
    bad = llm_args_dict()
    bad["kv_cache_config"]["host_cache_size"] = 1 << 30
    bad["max_beam_width"] = 2
    bad["scheduler_config"] = {"capacity_scheduler_policy": type("E", (), {"name": "GUARANTEED_NO_EVICT"})()}
    with pytest.raises(ValueError) as err:
        check_llm_args(bad)
    lines = str(err.value).splitlines()
    assert len(lines) == 4
    assert "kv_cache_config.host_cache_size must be None or 0 (got 1073741824)" in lines[1]
    assert "max_beam_width must be None or 1 (got 2)" in lines[2]
    assert "capacity_scheduler_policy must be 'MAX_UTILIZATION' (got 'GUARANTEED_NO_EVICT')" in lines[3]
    # TensorRT-LLM's defaults: fine (overlap scheduler, partial reuse); chunked prefill and NGram too
    check_llm_args({**llm_args_dict(), "disable_overlap_scheduler": False, "enable_chunked_prefill": True,
                    "kv_cache_config": {"enable_partial_reuse": True, "copy_on_partial_reuse": False},
                    "speculative_config": {"decoding_type": "NGram", "max_draft_len": 4}})
    for other in ("MTP", "Eagle", "Draft_Target"):  # drafts vToken's step does not see
        with pytest.raises(ValueError, match="speculative_config.decoding_type must be None or 'NGram'"):
            check_llm_args({**llm_args_dict(), "speculative_config": {"decoding_type": other}})


def test_pipeline_parallelism_is_refused_tensor_parallelism_is_not():
    """``PyExecutor._executor_loop_pp`` (py_executor.py, index ids 736889464, 3542389387) never
    hands ``scheduled_batch.paused_requests`` to ``_pause_requests``, which the single-rank loops
    do (TensorRT-LLM issue #18115); vToken needs MAX_UTILIZATION, the policy that pauses."""
    from tests.integration.trtllm121.tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    check_llm_args({**llm_args_dict(), "tensor_parallel_size": 4, "pipeline_parallel_size": 1})
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be None or 1 \(got 2\): TensorRT-LLM's "
                                         r"pipeline-parallel loop .* issue #18115"):
        check_llm_args({**llm_args_dict(), "pipeline_parallel_size": 2})
    args = TorchLlmArgs(model="tiny", **{k: v for k, v in llm_args_dict().items() if k != "kv_cache_config"},
                        pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be None or 1"):
        check_llm_args(args)


def test_disaggregated_serving_and_piecewise_cuda_graphs_are_refused():
    """TorchLlmArgs fields (1.2-era llmapi/llm_args.py: ``cache_transceiver_config``,
    ``TorchCompileConfig.enable_piecewise_cuda_graph``), as a mapping and as the args double."""
    from tests.integration.trtllm121.tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    bad = {**llm_args_dict(), "cache_transceiver_config": {"backend": "UCX"},
           "torch_compile_config": {"enable_piecewise_cuda_graph": True}}
    with pytest.raises(ValueError) as err:
        check_llm_args(bad)
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert "cache_transceiver_config must be None (got {'backend': 'UCX'}): disaggregated serving" in lines[1]
    assert "torch_compile_config.enable_piecewise_cuda_graph must be None or False (got True)" in lines[2]
    check_llm_args({**llm_args_dict(), "torch_compile_config": {"enable_piecewise_cuda_graph": False}})
    args = TorchLlmArgs(model="tiny", **{k: v for k, v in llm_args_dict().items() if k != "kv_cache_config"},
                        cache_transceiver_config={"backend": "UCX"})
    with pytest.raises(ValueError, match="cache_transceiver_config must be None"):
        check_llm_args(args)


def test_model_yaml_example_matches_the_required_arguments():
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "examples" / "trtllm" / "model.yaml").read_text()
    config = yaml.safe_load(text)
    check_llm_args(config)
    expected = llm_args_dict(settings=VTokenSettings(policy="h2o", budget=0.5))
    assert {k: config[k] for k in expected if k != "env_overrides"} == \
        {k: v for k, v in expected.items() if k != "env_overrides"}
    assert config["env_overrides"]["VTOKEN_TRTLLM"] == "1"  # settings compared as values (new fields default)
    assert VTokenSettings.from_env(config["env_overrides"]) == VTokenSettings(policy="h2o", budget=0.5)


# ---- block offsets ------------------------------------------------------------------------------------
def test_offsets_encode_blocks_in_layer_half_block_units():
    assert encode([0, 3, 7], layers_in_pool=28).tolist() == [[0, 168, 392], [1, 169, 393]]
    assert encode([5], layers_in_pool=3, kv_factor=1).tolist() == [[15], [15]]
    assert decode(encode([2, 9, 4], 30)[0], 30).tolist() == [2, 9, 4]
    with pytest.raises(ValueError, match="overflows"):
        encode([1 << 26], layers_in_pool=32)
    with pytest.raises(ValueError, match="pool-tier bits"):
        decode([1 << 30], 1)
    with pytest.raises(ValueError, match="negative"):
        encode([-1], 2)


def test_write_row_rewrites_the_static_table_in_place():
    table = torch.full((1, 3, 2, 4), -7, dtype=torch.int32)
    address = table.data_ptr()
    write_row(table, 0, 1, [6, 2], layers_in_pool=2)
    assert table.data_ptr() == address
    assert table[0, 1].tolist() == [[24, 8, -7, -7], [25, 9, -7, -7]]
    assert (table[0, 0] == -7).all() and (table[0, 2] == -7).all()
    as_numpy = np.zeros((1, 1, 2, 2), dtype=np.int32)
    write_row(as_numpy, 0, 0, [1], layers_in_pool=4)
    assert as_numpy[0, 0].tolist() == [[8, 0], [9, 0]]
    with pytest.raises(ValueError, match="exceed max_blocks_per_seq"):
        write_row(as_numpy, 0, 0, [1, 2, 3], layers_in_pool=4)


# ---- the manager over the 1.2.1 doubles -----------------------------------------------------------
def make_manager(policy: str, budget=8, num_blocks=64, mapping=None, num_layers=LAYERS, num_kv_heads=KV_HEADS,
                 dtype=DataType.BF16, **extra):
    """``VTokenKVCacheManager`` over the ``KVCacheManager`` double, built as ``KvCacheCreator`` does
    (keyword arguments, bf16 pool, ``max_tokens`` fixing the block count)."""
    options = extra.pop("policy_options", POLICY_OPTIONS.get(policy, {}))
    settings = VTokenSettings(policy=policy, budget=budget, policy_options=options, check_invariants=True, **extra)
    cls = build_manager_class(KVCacheManager)
    config = KvCacheConfig(enable_block_reuse=False, enable_partial_reuse=False, max_tokens=num_blocks * TPB,
                           tokens_per_block=TPB)
    return cls(config, CacheType.SELF, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=DIM,
               tokens_per_block=TPB, max_seq_len=64, max_batch_size=4, mapping=mapping or Mapping(),
               dtype=dtype, vtoken_settings=settings)


def write_new_kv(manager, request, gen: torch.Generator) -> None:
    """The forward's KV write: random K/V at the physical positions this iteration added to the
    request (its prompt, or one token), through TensorRT-LLM's block list."""
    step, req_id = manager.vtoken.step, request.py_request_id
    start, count = (step.kv_len(req_id), 1) if req_id in step else (0, request.prompt_len)
    blocks = manager.get_cache_indices(request)
    pool = step.executor.pools[0]
    for p in range(start, start + count):
        pool[blocks[p // TPB], :, :, :, p % TPB] = torch.randn(pool[0, :, :, :, 0].shape, generator=gen)


@pytest.mark.parametrize("policy", POLICIES.names())
def test_manager_compacts_rewinds_and_agrees_with_the_allocator(policy):
    manager, gen = make_manager(policy), torch.Generator().manual_seed(1)
    step = manager.vtoken.step
    copies = []
    submit_slots = step.executor.submit_slots
    step.executor.submit_slots = lambda src, dst: copies.append(len(src)) or submit_slots(src, dst)
    requests = [make_request(req, prompt_len=5 + 3 * req, max_new_tokens=20) for req in range(3)]
    prefill = ScheduledRequests(context_requests=requests)
    manager.prepare_resources(prefill)
    for request in requests:
        write_new_kv(manager, request, gen)
    manager.update_resources(prefill)  # the step registers the prompts (the policy may evict)
    for _ in range(20):
        batch = ScheduledRequests(generation_requests=requests)
        manager.prepare_resources(batch)  # TensorRT-LLM's add_token, on the physical length
        for request in requests:
            req = request.py_request_id
            write_new_kv(manager, request, gen)
            held = manager.get_cache_indices(request)
            assert held[: step.num_blocks(req)] == step.block_ids(req) and len(held) - step.num_blocks(req) <= 1
            assert manager.vtoken_evicted(req) == step.num_tokens(req) - step.kv_len(req)
        metadata = build_metadata_class(TrtllmAttentionMetadata)(
            max_num_requests=4, kv_cache_manager=manager, request_ids=[r.py_request_id for r in requests],
            prompt_lens=[r.prompt_len for r in requests], num_contexts=0, seq_lens=torch.tensor([1] * 3),
            kv_cache_params=KVCacheParams(use_cache=True, num_cached_tokens_per_seq=[
                step.num_tokens(r.py_request_id) for r in requests]))
        metadata.prepare()
        assert metadata.kv_lens[:3].tolist() == [step.kv_len(r.py_request_id) + 1 for r in requests]  # physical
        for row, request in enumerate(requests):  # the offsets the kernels read name TensorRT-LLM's blocks
            blocks = manager.get_cache_indices(request)
            assert decode(metadata.kv_cache_block_offsets[0, row, 0, : len(blocks)], LAYERS).tolist() == blocks
        if manager.vtoken.needs_attention:  # the forward recorded decode queries
            for layer in range(LAYERS):
                manager.vtoken_queries.record(layer, torch.randn(3, HEADS * DIM, generator=gen), 3)
        manager.update_resources(batch)  # one step: register, decide, compact, copy, rewind
        for request in requests:
            req = request.py_request_id
            # TensorRT-LLM and vToken agree on the block list; every position below kv_len is live (dense).
            assert manager.get_cache_indices(request) == step.block_ids(req)
            assert step.num_live(req) == step.kv_len(req) <= 8  # the policy kept the budget
        step.check_integrity()
    stats = step.stats
    assert stats.tokens_evicted > 0 and stats.compactions > 0
    assert len(copies) <= 21 and sum(copies) == stats.moves  # one copy per step for every request's moves
    assert max(copies) > 1
    assert stats.invariant_checks == stats.compactions  # I1/I2 on every compaction
    assert stats.blocks_freed > 0
    for request in requests:
        manager.free_resources(request)
    assert manager.get_num_free_blocks() == 64 and not step.request_ids()


def test_manager_publishes_its_counters_for_the_metrics(tmp_path):
    """The worker-side half of the TensorRT-LLM path's metrics: every metric name is one the
    Triton model exports, and the file agrees with the manager after each request leaves."""
    stats = tmp_path / "stats.json"
    manager, gen = make_manager("sliding_window", budget=6, stats_file=str(stats)), torch.Generator().manual_seed(2)
    requests = [make_request(req, prompt_len=9, max_new_tokens=12) for req in range(2)]
    for i in range(13):
        batch = ScheduledRequests(**{"generation_requests" if i else "context_requests": requests})
        manager.prepare_resources(batch)
        for request in requests:
            write_new_kv(manager, request, gen)
        manager.update_resources(batch)
    assert read_stats(stats) is not None and manager.vtoken_stats.writes >= 1
    manager.free_resources(requests[0])
    published = read_stats(stats)
    assert set(published) <= {spec.name for spec in METRICS}
    step, stats = manager.vtoken.step, manager.vtoken.step.stats
    assert published["vtoken_requests_running"] == 1
    assert published["vtoken_kv_blocks_retained"] == step.num_blocks(1) == 64 - manager.get_num_free_blocks()
    assert published["vtoken_kv_utilization"] == step.num_live(1) / (step.num_blocks(1) * TPB)
    assert published["vtoken_tokens_evicted"] == stats.tokens_evicted > 0
    assert (published["vtoken_relocations"], published["vtoken_tokens_relocated"]) == (stats.compactions, stats.moves)
    assert published["vtoken_bytes_copied"] == stats.bytes_copied > 0
    assert published["vtoken_blocks_reclaimed"] == stats.blocks_freed > 0


def test_stats_file_writes_at_most_once_per_interval(tmp_path):
    now = [0.0]
    stats = StatsFile(tmp_path / "s.json", interval_s=0.5, clock=lambda: now[0])
    assert read_stats(tmp_path / "s.json") is None  # nothing published yet
    assert stats.maybe_write(lambda: {"vtoken_relocations": 1})
    now[0] = 0.4
    assert not stats.maybe_write(lambda: {"vtoken_relocations": 2})
    assert stats.maybe_write(lambda: {"vtoken_relocations": 3}, force=True)
    now[0] = 1.0
    assert stats.maybe_write(lambda: {"vtoken_relocations": 4})
    assert read_stats(tmp_path / "s.json") == {"vtoken_relocations": 4.0} and stats.writes == 3
    (tmp_path / "s.json").write_text("{not json")
    assert read_stats(tmp_path / "s.json") is None
    with pytest.raises(ValueError, match="stats_interval_s must be positive"):
        VTokenSettings(stats_interval_s=0)


def test_requests_give_tokens_up_a_block_at_a_time():
    """A 40-token prompt with a budget of 8 keeps 8 (32 lost: 8 blocks); the next token would make
    9 live, so a whole block goes (5 live); then it grows back to 8 before the next block goes.
    What a request has lost stays a multiple of tokens_per_block, so the C++ manager's length
    after the rewinds stays congruent to the logical length: TensorRT-LLM's scheduler, which counts
    a request's next block from its logical length, counts the block add_token will take."""
    manager, gen = make_manager("sliding_window", budget=8), torch.Generator().manual_seed(3)
    request = make_request(0, prompt_len=40, max_new_tokens=60)
    step, live = manager.vtoken.step, []
    for i in range(10):
        batch = ScheduledRequests(**{"generation_requests" if i else "context_requests": [request]})
        manager.prepare_resources(batch)
        write_new_kv(manager, request, gen)
        manager.update_resources(batch)
        request.add_new_token(7, 0)  # the sampler's token: the logical length grows
        live.append(step.num_live(0))
        assert (step.num_tokens(0) - step.num_live(0)) % TPB == 0
        assert manager.num_tokens_in_sequence(0) % TPB == step.num_tokens(0) % TPB
        assert manager.get_cache_indices(request) == step.block_ids(0)
    assert live == [8, 5, 6, 7, 8, 5, 6, 7, 8, 5]


def test_refused_settings():
    cls = build_manager_class(KVCacheManager)
    settings = VTokenSettings(policy="random", budget=8)
    keywords = dict(num_layers=1, num_kv_heads=1, head_dim=2, tokens_per_block=4, max_seq_len=8, max_batch_size=1,
                    mapping=Mapping(), vtoken_settings=settings)
    cls(KvCacheConfig(), CacheType.SELF, **keywords)  # the real default: block and partial reuse on, fine
    with pytest.raises(ValueError, match="max_beam_width=1"):
        cls(KvCacheConfig(enable_block_reuse=False), CacheType.SELF, max_beam_width=2, **keywords)


def test_padding_rows_and_unknown_requests_are_empty():
    from trtllm_vtoken.integration.trtllm.state import CUDA_GRAPH_DUMMY_REQUEST_ID

    manager = make_manager("random")
    assert manager.vtoken_evicted(CUDA_GRAPH_DUMMY_REQUEST_ID) == 0 and manager.vtoken_evicted(17) == 0
    assert manager.vtoken.run([(CUDA_GRAPH_DUMMY_REQUEST_ID, [0], 1, 1)]) is None
    assert CUDA_GRAPH_DUMMY_REQUEST_ID not in manager.vtoken.step


# ---- the real thing, where it imports ---------------------------------------------------------------
@pytest.mark.skipif(HAS_TRTLLM, reason="checks the error without tensorrt_llm")
def test_install_without_tensorrt_llm_is_a_clear_error(monkeypatch):
    from trtllm_vtoken.integration.trtllm import vtoken_llm_args
    from trtllm_vtoken.integration.trtllm.patches import install

    monkeypatch.delenv("VTOKEN_TRTLLM", raising=False)
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(RuntimeError, match="tensorrt_llm is not importable"):
        install(VTokenSettings())
    with pytest.raises(RuntimeError, match="tensorrt_llm is not importable"):
        vtoken_llm_args()


@pytest.mark.trtllm
def test_install_patches_tensorrt_llm():
    from trtllm_vtoken.integration.trtllm.patches import install

    patched = install(VTokenSettings())
    assert any("get_kv_cache_manager_cls -> VTokenKVCacheManager" in p for p in patched)
    from tensorrt_llm._torch.attention_backend.trtllm import TrtllmAttention

    assert TrtllmAttention.support_fused_rope() is False
    assert TrtllmAttention.Metadata.__qualname__.startswith("VTokenAttentionMetadata")
