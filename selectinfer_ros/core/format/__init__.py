"""The model on disk: neuron-major packs (one record per FFN neuron), safetensors I/O, int8
records and the kernels that read them, the embedded default model and its cache."""
