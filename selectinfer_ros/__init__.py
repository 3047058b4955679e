"""selectinfer_ros: a ROS 2 package serving an LLM with selective neuron loading (SelectInfer).

The layout follows the data (each layer imports only the ones below it)::

    core/format     packed neuron-major model files, int8 records and kernels, the model cache
    core/options    every setting: name, type, default, range (one place)
    core/selection  profiles, which neurons are resident and active, the task switch
    core/execution  prefill/decode, generation, choices, metrics
    core/profiling  scoring neurons over prompt sets, quality curves
    core/serving    what nodes and the CLI serve: the runtime and the goal queue
    lab             measuring tools (bench, eval, quantization baselines)
    cli             the ``selectinfer`` command (lab registers its subcommands)
    ros             everything that imports rclpy: nodes, client facade, behaviours, bring-up
"""
import os as _os

# The weights in 2 MiB pages: PyTorch's CPU allocator aligns allocations of 2 MiB and more to
# 2 MiB and asks for transparent huge pages (madvise) where this is set before torch is first
# imported. A decode step streams every resident weight once; with 4 KiB pages each 4 KiB is a
# TLB miss and a page the hardware prefetchers stop at. Qwen2.5 1.5B 4-bit records, one Zen 4
# core: the MLP product from memory 16-18 -> 20-21 GB/s. THP_MEM_ALLOC_ENABLE=0 turns it off;
# a torch without the setting ignores it.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
