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
