"""`--hardware NAME --nodes N`: a one-node profile (a preset, a TOML file or the detected machine) as N such nodes.

Only the node count changes: GPUs, their memory, the links inside a node, cores and RAM are per node already
(hardware/profile.py). Between the nodes runs the profile's own fabric (`inter_node`, `inter_node_gbps`: the
8-GPU node presets name the ports their machines ship with), so a profile without one cannot be multiplied. A
cluster profile (nodes > 1, e.g. jean-zay-a100-48n) is the cluster it describes: --nodes may only repeat its count.
"""

from __future__ import annotations

from dataclasses import replace

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware, load_hardware
from appliance.presets import list_presets


def hardware_for(name: str | None, nodes: int | None = None) -> Hardware:
    """--hardware NAME (default: this machine, detected) and --nodes N (default: the profile's own node count)."""
    if name:
        hardware = load_hardware(name)
    else:
        from appliance.hardware.detect import detect

        hardware = detect()
    return hardware if nodes is None else with_nodes(hardware, nodes)


def with_nodes(hardware: Hardware, nodes: int) -> Hardware:
    """`hardware` as `nodes` nodes; BadInput naming --nodes and the fix when it is not a profile of one node."""
    what = "this machine" if hardware.name in ("", "detected") else hardware.name
    if nodes < 1:
        raise BadInput(f"--nodes {nodes}: must be 1 or more")
    if nodes == hardware.nodes:
        return hardware
    if hardware.nodes > 1:
        raise BadInput(
            f"--nodes {nodes}: {what} is a {hardware.nodes}-node cluster, not a one-node profile; --nodes multiplies"
            f" one node ({', '.join(node_presets())})"
        )
    if hardware.inter_node == "none" or hardware.inter_node_gbps <= 0:
        raise BadInput(
            f"--nodes {nodes}: {what} names no link between nodes (inter_node = {hardware.inter_node!r}); use a node"
            f" preset that does ({', '.join(node_presets())}) or a profile TOML with nodes, inter_node and"
            " inter_node_gbps"
        )
    return replace(
        hardware,
        nodes=nodes,
        name=f"{nodes} x {hardware.name}" if hardware.name else "",
        description=f"{nodes} nodes of {hardware.description or what}",
    )


def node_presets() -> list[str]:
    """The hardware presets --nodes can multiply: one node, with a link to other nodes."""
    out = []
    for name in list_presets("hardware"):
        hardware = load_hardware(name)
        if hardware.nodes == 1 and hardware.inter_node != "none" and hardware.inter_node_gbps > 0:
            out.append(name)
    return out
