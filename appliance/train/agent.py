"""PyTorch's elastic agent (`torch.distributed.run`, unchanged: its arguments, rendezvous, restarts and errors), which
leaves without the interpreter's teardown once its ranks have finished (appliance/process_exit.py: ~1 s of every
train stage's end). The launcher runs it as `python -m appliance.train.agent <torch.distributed.run's arguments>`."""

from __future__ import annotations

from appliance.output_dirs import restrict_umask
from appliance.process_exit import exit_without_teardown


def main() -> None:
    from torch.distributed.run import main as run_agent

    restrict_umask()  # under SLURM no command line starts the agent: its ranks' logs and files get the modes here
    run_agent()  # a failed launch raises (ChildFailedError) and exits as torch.distributed.run's own would
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
