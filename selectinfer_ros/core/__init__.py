"""The ROS-free core, in pipeline order: format -> options -> selection -> execution ->
profiling / serving. Imports neither rclpy nor :mod:`selectinfer_ros.lab`."""
