"""One training rank's process: its entry point (`worker.py`, started as `python -m appliance.rank.worker`).

It sits above both `train` and `eval`: a rank trains, then runs the final evaluation on the model it holds."""
