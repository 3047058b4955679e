"""ROS 2 nodes: thin adapters from messages and parameters to :mod:`selectinfer_ros.core`."""
