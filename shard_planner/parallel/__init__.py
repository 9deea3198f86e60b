"""The parallel layout (parallel/mesh.py: the degrees and every size and group placement derived from them) and a
plan's tensor parallelism (parallel/tensor_parallel.py: which module is split how). Vocabulary: no torch, nothing
above the leaves; deriving a model's styles by tracing it is trace/tp_styles.py's."""
