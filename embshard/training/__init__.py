"""The training loop: `embshard train`'s run (`train`), the pipeline that overlaps the next batch's copy and id
exchange with the current step (`pipeline`), the CUDA graphs of the dense step and the whole step
(`dense_graph`, `step_graph`), which the loop owns with the compiled dense forward (`model_graphs`)."""
