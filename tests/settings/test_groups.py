"""Each group's own checks beyond its settings' ranges (cross-field ones, values normalized from their text), and the
LoRA flags as vLLM spells them."""

from __future__ import annotations

import argparse

import pytest

from proto.parallel import ParallelLayout
from proto.wire import ExecutionMode
from settings.bench import BenchLoad
from settings.cli import Part, add_settings, from_args
from settings.engine import EngineConfig
from settings.kv_compact import DEFAULT_COMPACT_FRACTION, CompactKV
from settings.lora import LoraConfig, parse_lora_module
from settings.process import Tls
from settings.router import Replicas, parse_replica
from settings.scheduler import PreemptionMode, SchedulerConfig
from settings.server import Operations
from settings.speculative import SpeculativeConfig, speculative_text
from settings.tools import Convert

pytestmark = pytest.mark.unit


def test_the_lora_flags_as_vllm_spells_them() -> None:
    p = argparse.ArgumentParser()
    add_settings(p, [Part(LoraConfig)])
    args = p.parse_args(["--enable-lora", "--lora-modules", "a=/x", "b=/y/z", "--max-lora-rank", "64"])
    config = from_args(LoraConfig, args)
    assert config == LoraConfig(True, ("a=/x", "b=/y/z"), 64)
    assert config.modules == [("a", "/x"), ("b", "/y/z")]
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_module("just-a-name")
    with pytest.raises(ValueError, match="expected name=path"):
        LoraConfig(True, ("just-a-name",))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        from_args(LoraConfig, p.parse_args(["--lora-modules", "a=/x"]))


def test_an_unset_compact_fraction_follows_the_memory_sensitive_mode() -> None:
    assert CompactKV().fraction == 0.0
    assert CompactKV(under_pressure=True).fraction == DEFAULT_COMPACT_FRACTION
    assert CompactKV(0.2, under_pressure=True).fraction == 0.2
    with pytest.raises(ValueError, match="needs a compact pool"):
        CompactKV(0.0, under_pressure=True)


def test_the_scheduler_normalizes_its_speculation_and_preemption_mode() -> None:
    config = SchedulerConfig(speculative='{"method": "ngram"}', preemption_mode="swap")  # type: ignore[arg-type]
    assert config.speculative == SpeculativeConfig() and config.preemption_mode is PreemptionMode.SWAP
    assert SchedulerConfig(speculative={"method": "ngram"}).speculative == SpeculativeConfig()  # type: ignore[arg-type]
    assert SchedulerConfig(speculative="").speculative is None  # type: ignore[arg-type]
    assert speculative_text({"method": "ngram", "num_speculative_tokens": 2}).startswith('{"method": "ngram"')


def test_the_engine_says_its_world() -> None:
    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=False)
    assert config.layout == ParallelLayout(2, 2)
    assert config.mode == ExecutionMode.for_world(2, 2, False)


def test_cross_field_and_range_checks_of_the_processes() -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        Tls(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="heartbeat_timeout must be > 0"):
        Operations(heartbeat_timeout=0)
    with pytest.raises(ValueError, match="probe_interval must be > 0"):
        Replicas(probe_interval=0)
    assert Replicas(replica=(parse_replica("127.0.0.1:1,model=m"),)).replica[0].model == "m"


def test_the_tools_take_their_own() -> None:
    p = argparse.ArgumentParser()
    add_settings(p, [Part(Convert), Part(BenchLoad)])
    with pytest.raises(SystemExit):
        p.parse_args([])  # --input and --output are required
    args = p.parse_args(["--input", "m.gguf", "--output", "out", "--goodput", "ttft:500", "tpot:50"])
    assert (args.input, args.goodput) == ("m.gguf", ["ttft:500", "tpot:50"])
