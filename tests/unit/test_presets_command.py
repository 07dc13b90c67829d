"""`presets` names every preset under presets/ with its shape, one line each; --help of the commands that take a
preset name says where the names are; the README's preset tables are the command's figures."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from test_readme_commands import README, subcommands

from appliance import cli
from appliance.cli_parser import build_parser

ROOT = Path(__file__).resolve().parents[2]


def toml(kind: str) -> dict[str, dict[str, Any]]:
    """presets/<kind>/*.toml by name, read here without the appliance's loaders."""
    out = {}
    for path in sorted((ROOT / "presets" / kind).glob("*.toml")):
        with path.open("rb") as f:
            out[path.stem] = tomllib.load(f)
    return out


def presets_output(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert cli.main(["presets", *flags]) == 0
    return capsys.readouterr().out


def test_presets_json_lists_every_preset_file_once_with_its_shape(capsys):
    listed = json.loads(presets_output(capsys, "--json"))
    models, hardware = toml("models"), toml("hardware")
    assert sorted(m["name"] for m in listed["models"]) == sorted(models)
    assert sorted(h["name"] for h in listed["hardware"]) == sorted(hardware)
    for m in listed["models"]:
        table = models[m["name"]]
        assert (m["layers"], m["hidden"], m["heads"], m["seq_len"]) == (
            table["layers"], table["hidden"], table["heads"], table["seq_len"]
        ), m["name"]  # fmt: skip
        assert m["experts"] == table.get("moe_num_experts", 0)
    for h in listed["hardware"]:
        table = hardware[h["name"]]
        assert (h["nodes"], h["gpus_per_node"], h["gpu"], h["gpu_memory_gb"], h["intra_node"], h["inter_node"]) == (
            table["nodes"], table["gpus_per_node"], table["gpu"], table["gpu_memory_gb"], table["intra_node"],
            table["inter_node"],
        ), h["name"]  # fmt: skip
    # BLOOM-176B's published count (its model card), not just what the planner computes.
    assert next(m for m in listed["models"] if m["name"] == "bloom-176b")["parameters"] == 176_247_271_424


def test_presets_prints_one_line_per_preset(capsys):
    lines = presets_output(capsys).splitlines()
    names = [*toml("models"), *toml("hardware")]
    rows = [line for line in lines if line.startswith("  ")]
    assert sorted(line.split()[0] for line in rows) == sorted(names)
    assert "  bloom-176b" in "\n".join(rows) and "176B params" in next(r for r in rows if r.split()[0] == "bloom-176b")
    assert "48 x 8 A100-SXM4-80GB (80 GB)" in next(r for r in rows if r.split()[0] == "jean-zay-a100-48n")


@pytest.mark.parametrize("command", ["run", "plan", "sbatch"])
def test_help_of_commands_taking_a_preset_says_presets_lists_the_names(command):
    text = " ".join(subcommands(build_parser())[command].format_help().split())
    assert text.count("`presets` lists the names") == 2, text  # after --model and after --hardware


def test_count_text_reads_as_parameter_counts_are_quoted():
    from appliance.cli_presets import count_text

    assert [count_text(n) for n in (950, 132_992, 559_214_592, 1_722_408_960, 176_247_271_424)] == [
        "950", "133k", "559M", "1.72B", "176B"
    ]  # fmt: skip


def model_table(models: list[dict[str, Any]]) -> str:
    """The README's table of model presets, from `presets`' figures."""
    from appliance.cli_presets import count_text

    rows = [
        "| `--model` | parameters | layers | hidden | heads | seq_len | experts |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in models:
        rows.append(
            f"| `{m['name']}` | {count_text(m['parameters'])} | {m['layers']} | {m['hidden']} | {m['heads']}"
            f" | {m['seq_len']} | {m['experts'] or ''} |"
        )
    return "\n".join(rows)


def hardware_table(hardware: list[dict[str, Any]]) -> str:
    """The README's table of hardware presets, from `presets`' figures."""
    rows = [
        "| `--hardware` | nodes x GPUs | GPU | memory per GPU | in a node | between nodes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for h in hardware:
        gpu = h["gpu"] if h["gpus_per_node"] else f"none ({h['cpu_cores']} CPU cores)"
        memory = f"{h['gpu_memory_gb']:g} GB" if h["gpus_per_node"] else ""
        between = f"{h['inter_node']} {h['inter_node_gbps']:g} Gb/s" if h["nodes"] > 1 else ""
        rows.append(
            f"| `{h['name']}` | {h['nodes']} x {h['gpus_per_node']} | {gpu} | {memory}"
            f" | {h['intra_node']} {h['intra_node_gbps']:g} Gb/s | {between} |"
        )
    return "\n".join(rows)


@pytest.mark.parametrize(("render", "kind"), [(model_table, "model_presets"), (hardware_table, "hardware_presets")])
def test_the_readme_preset_tables_are_the_presets(render, kind):
    import appliance.cli_presets

    expected = render(getattr(appliance.cli_presets, kind)())
    assert expected in README, f"README.md's preset table is out of date; it should read:\n{expected}"


def test_the_readme_table_check_sees_a_preset_added():
    """Control: one more preset file would make the README's table out of date."""
    from appliance.cli_presets import model_presets

    models = model_presets()
    assert model_table(models) in README
    assert model_table([*models, {**models[0], "name": "bloom-new"}]) not in README
