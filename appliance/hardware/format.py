"""Hardware as a person reads it (`detect` without --json)."""

from __future__ import annotations

from appliance.hardware.profile import Hardware
from appliance.hardware.specs import gpu_spec


def format_hardware(hw: Hardware) -> str:
    lines = [f"Hardware: {hw.name or 'unnamed'}" + (f" ({hw.description})" if hw.description else "")]
    if hw.has_gpus:
        spec = gpu_spec(hw.gpu)
        rate = f", {spec.peak_tflops:g} TFLOPs peak {'bf16' if spec.bf16 else 'fp16'}" if spec else ""
        lines.append(
            f"  GPUs      {hw.nodes} node(s) x {hw.gpus_per_node} x {hw.gpu} ({hw.gpu_memory_gb:g} GB{rate})"
            f" = {hw.world_gpus} GPUs"
        )
    else:
        lines.append(f"  GPUs      none: CPU ranks ({hw.nodes} node(s) x {hw.cpu_cores} cores)")
    per = "GPU" if hw.has_gpus else "rank"
    lines.append(f"  in node   {hw.intra_node}, {hw.intra_node_gbps:g} Gb/s per {per} and direction")
    lines.append(f"  between   {hw.inter_node}, {hw.inter_node_gbps:g} Gb/s per node and direction")
    lines.append(f"  host      {hw.cpu_cores} cores, {hw.ram_gb:g} GB RAM per node")
    for g in hw.gpus:
        nvlink = f"NVLink {g.nvlink_active}/{g.nvlink_links} up" if g.nvlink_links else "no NVLink"
        p2p = f"P2P with {','.join(map(str, g.p2p))}" if g.p2p else "no P2P"
        power = f"{g.power_limit_w:g} W limit" if g.power_limit_w is not None else "power limit unknown"
        lines.append(f"  gpu {g.index:<5} {g.name}, {g.memory_gb:g} GB, {nvlink}, {p2p}, {power}")
    for label, ports in (("ib", hw.infiniband), ("opa", hw.omnipath)):
        for p in ports:
            lines.append(f"  {label:<9} {p.device} port {p.port}: {p.state}, {p.rate_gbps:g} Gb/s, {p.link_layer}")
    for e in hw.ethernet:
        speed = f"{e.speed_gbps:g} Gb/s" if e.speed_gbps else "speed unknown"
        lines.append(f"  eth       {e.interface}: {e.operstate}, {speed}{' (virtual)' if e.virtual else ''}")
    if hw.slurm:
        s = hw.slurm
        lines.append(
            f"  slurm     job {s.job_id}: {s.nodes} node(s) [{s.node_list or '?'}], tasks {s.tasks or '?'}"
            f" ({s.tasks_per_node or '?'} per node), GPUs per node {s.gpus_per_node or '?'}"
        )
    for note in hw.notes:
        lines.append(f"  note      {note}")
    return "\n".join(lines)
