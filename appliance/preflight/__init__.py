"""Preflight: every role of a plan's layout built and stepped in this one process, in an emulated world.

A multi-GPU plan is arithmetic until its ranks run (planner/memory.py, planner/timing.py). The ranks of a layout fall
into a few roles (roles.py): the first pipeline stage (word embedding), the middle stages, the last (final LayerNorm,
tied LM head and loss); the tp, dp, cp and ep ranks of one stage hold tensors of the same shapes. For each role this
package builds one rank through the engine build every rank runs (parallel/step/build.py ``build_engine``), with its
tensor-parallel shards, micro-batch, recompute and ZeRO partition, inside torch's fake process group (world.py:
collectives return without sending), runs a few training steps on random tokens and counts what the built rank holds
(measure.py): parameter, gradient and optimizer-state bytes from its tensors, the peak of the activations autograd
keeps, the time per micro-batch. run.py sets each beside the planner's figure and gives the verdict (report.py).

Pipeline stages run under DeepSpeed's own PipelineEngine: the stage that would receive activations gets buffers of
the shape the first stage sends (world.py ``StageHandoff``), filled with random values, and the gradients a stage
would receive stay the zeros the fake group leaves in its buffers; the arithmetic of every stage is the real one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.planner.runspec import RunSpec
    from appliance.preflight.report import Preflight


def run_preflight(spec: RunSpec) -> Preflight:
    """``spec``'s roles built and stepped here (run.py), standard output kept for the command's own."""
    from appliance.preflight.world import stdout_to_stderr

    with stdout_to_stderr():  # DeepSpeed announces its accelerator on stdout when it is imported
        from appliance.preflight.run import preflight

    return preflight(spec)
