"""The scheduler article's multi-GPU template in a config file: `gpu_topology` becomes an inline topology,
`scheduling_policy: {cross_device, memory_sharing}` the replicas' settings; bad keys, bad values and keys of another
command are refused naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler_node.cli.scheduler import build_parser as scheduler_parser
from scheduler_node.cli.serve import build_parser as serve_parser
from settings.config_file import parse_args
from settings.topology import TopologyKeyError, policy_values, topology_value
from tests.seeds.blocks import block

pytestmark = pytest.mark.unit

ARTICLE = "\n" + block("gpu_topology").text + "\n"  # article 000, section 6.2


def test_the_articles_template_sets_the_topology_and_the_replicas_policy(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("device: cpu\ndata_parallel_size: 2\n" + ARTICLE)
    args = parse_args(serve_parser(), ["--config", str(config)])
    assert json.loads(args.topology) == {
        "device": "cpu",
        "groups": [
            {"device_ids": [0, 1, 2, 3], "interconnect": "nvlink"},
            {"device_ids": [4, 5, 6, 7], "interconnect": "pcie"},
        ],
    }
    assert (args.cross_device, args.memory_sharing, args.routing_strategy) == ("round_robin", True, "round_robin")
    assert args.scheduling_policy == "fcfs"  # the engine's queue policy keeps its default
    config.write_text(
        "device: cuda\nscheduling_policy: priority\ngpu_topology: [{device_ids: [0], interconnect: pcie}]"
    )
    args = parse_args(serve_parser(), ["--config", str(config)])
    assert (json.loads(args.topology)["device"], args.scheduling_policy, args.memory_sharing) == (
        "cuda",
        "priority",
        False,
    )


def test_values_map_onto_settings() -> None:
    assert policy_values({"cross_device": "pack", "memory_sharing": "disabled"}) == {
        "cross_device": "pack",
        "memory_sharing": False,
    }
    assert policy_values({"memory_sharing": True}) == {"memory_sharing": True}
    assert json.loads(topology_value([{"device_ids": [0], "interconnect": "nvlink", "host": "a"}], "cuda")) == {
        "device": "cuda",
        "groups": [{"device_ids": [0], "interconnect": "nvlink", "host": "a"}],
    }


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"cross_device": "random"}, r"scheduling_policy.cross_device: one of pack, round_robin, got 'random'"),
        ({"memory_sharing": "sometimes"}, r"scheduling_policy.memory_sharing: enabled or disabled, got 'sometimes'"),
        ({"load_balance": "x"}, r"scheduling_policy: unknown key 'load_balance'"),
    ],
)
def test_bad_policy_keys_are_named(section: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyKeyError, match=message):
        policy_values(section)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([], r"gpu_topology: a list of"),
        (
            [{"device_ids": [0], "interconnect": "nvlink", "bandwidth": 900}],
            r"gpu_topology\[0\]: unknown key 'bandwidth'",
        ),
        (["0,1"], r"gpu_topology\[0\]: a mapping"),
    ],
)
def test_bad_topology_keys_are_named(groups: object, message: str) -> None:
    with pytest.raises(TopologyKeyError, match=message):
        topology_value(groups, "cuda")


@pytest.mark.parametrize(
    ("text", "parser", "message"),
    [
        ("topology: a.yaml\n" + ARTICLE, serve_parser, "gpu_topology and topology both give the devices"),
        ("routing_strategy: kv\n" + ARTICLE, serve_parser, "scheduling_policy.cross_device sets routing_strategy "
         "round_robin, the key routing_strategy says kv"),
        (ARTICLE, scheduler_parser, "scheduling_policy.cross_device is for the data-parallel replicas of vllm-serve"),
        ("gpu_topology: [{device_ids: [0], link: nvlink}]", serve_parser, "gpu_topology[0]: unknown key 'link'"),
    ],
)  # fmt: skip
def test_a_config_file_refuses_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, parser: object, message: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(parser(), ["--config", str(config)])  # type: ignore[operator]
    assert message in capsys.readouterr().err


def test_the_scheduler_takes_gpu_topology(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("gpu_topology: [{device_ids: [0, 1], interconnect: nvlink}]\n")
    assert json.loads(parse_args(scheduler_parser(), ["--config", str(config)]).topology)["groups"][0][
        "device_ids"
    ] == [0, 1]
