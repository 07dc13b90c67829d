"""`bench`: the trainer's tokens/s, TFLOPs and MFU against transformers (eager and torch.compile) on the same model,
batch, weights and optimizer, and every fused op against its torch twin and peers, measured in one run.

    workload.py       what every contender trains (the plan, on one device, sized by the flags) and the timing rule
    contenders.py     runs them: build, warm-up, timed steps, release; out-of-memory recorded, peak memory read
    trainer_speed.py  the trainer's real engine, one rank in this process
    hf_peers.py       transformers' BloomForCausalLM eager and compiled, and what is equal between them and us
    profile.py        --profile: a torch.profiler trace of each contender and its summary
    kernel_table.py   each op against its twin and peers at the trained shapes (bench/kernels.py: BLOOM-176B's)
    ceilings.py       the shared timer; copy bandwidth and matmul rate of this machine
    report.py         the JSON result and its table
    command.py        the command itself

It sits after train/ and eval/ in the layer order: it builds the trainer's engine through train/from_spec.py.
"""
