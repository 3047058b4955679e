"""selectinfer_ros: a ROS 2 package serving an LLM with selective neuron loading."""
