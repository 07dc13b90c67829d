"""`presets`: the names `--model` and `--hardware` take, one line each, read from presets/ as the planner reads them
(so a preset that does not load is an error here too, naming its file)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from appliance.presets import list_presets


def model_presets() -> list[dict[str, Any]]:
    """Every model preset's shape, smallest first: name, parameters, layers, hidden, heads, seq_len, experts (0 for
    a dense model), description."""
    from appliance.planner import load_model_shape

    found = []
    for name in list_presets("models"):
        shape = load_model_shape(name)
        found.append(
            {
                "name": name,
                "parameters": shape.parameters(),
                "layers": shape.layers,
                "hidden": shape.hidden,
                "heads": shape.heads,
                "seq_len": shape.seq_len,
                "experts": shape.moe_num_experts,
                "description": shape.description,
            }
        )
    return sorted(found, key=lambda m: (m["parameters"], m["name"]))


def hardware_presets() -> list[dict[str, Any]]:
    """Every hardware preset, fewest GPUs first: name, nodes, gpus_per_node, gpu, gpu_memory_gb, intra_node,
    inter_node (with their Gb/s), cpu_cores, ram_gb, description."""
    from appliance.hardware import load_hardware

    keys = (
        *("nodes", "gpus_per_node", "gpu", "gpu_memory_gb", "intra_node", "intra_node_gbps", "inter_node"),
        *("inter_node_gbps", "cpu_cores", "ram_gb", "description"),
    )
    found = []
    for name in list_presets("hardware"):
        profile = load_hardware(name).to_dict()
        found.append({"name": name, **{key: profile[key] for key in keys}})
    return sorted(found, key=lambda h: (h["nodes"] * h["gpus_per_node"], h["name"]))


def count_text(n: int) -> str:
    """133k, 559M, 1.72B, 176B, 1.04T: three significant figures, as parameter counts are quoted."""
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.3g}{suffix}"
    return str(n)


def model_line(m: dict[str, Any]) -> str:
    experts = f", {m['experts']} experts" if m["experts"] else ""
    return (
        f"{m['name']:<20} {count_text(m['parameters']):>6} params  {m['layers']:>3} layers  hidden {m['hidden']:>5}"
        f"  heads {m['heads']:>3}  seq {m['seq_len']:>5}{experts}"
    )


def hardware_line(h: dict[str, Any]) -> str:
    gpus = f"{h['nodes']} x {h['gpus_per_node']} {h['gpu']} ({h['gpu_memory_gb']:g} GB)" if h["gpus_per_node"] else (
        f"{h['nodes']} x {h['cpu_cores']} CPU cores, no GPU"
    )  # fmt: skip
    links = f"{h['intra_node']} {h['intra_node_gbps']:g} Gb/s"
    if h["nodes"] > 1:
        links += f", {h['inter_node']} {h['inter_node_gbps']:g} Gb/s between nodes"
    return f"{h['name']:<20} {gpus}; {links}"


def cmd_presets(args: argparse.Namespace) -> int:
    models, hardware = model_presets(), hardware_presets()
    if args.json:
        print(json.dumps({"models": models, "hardware": hardware}, indent=1))
        return 0
    print("models (--model NAME):")
    print("\n".join(f"  {model_line(m)}" for m in models))
    print("hardware (--hardware NAME; nodes x GPUs per node, GPU, its memory; links):")
    print("\n".join(f"  {hardware_line(h)}" for h in hardware))
    return 0
