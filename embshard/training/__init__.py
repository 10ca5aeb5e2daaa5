"""The training loop: `embshard train`'s run (`train`), the pipeline that overlaps the next batch's copy and id
exchange with the current step (`pipeline`), and the CUDA graphs of the dense step and the whole step
(`dense_graph`, `step_graph`)."""
