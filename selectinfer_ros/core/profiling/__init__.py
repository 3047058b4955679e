"""The offline profiler: neuron scores over task prompt sets and the quality curves."""
