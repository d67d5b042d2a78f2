"""The engine's steps replayed from CUDA graphs: decode steps by batch size (decode_graphs.py),
steps with prefill chunks as one flat batch by token count (flat_step_graphs.py). The kernels
they capture are cuda/'s; the rows they run are the model runner's (input_batch.py)."""
