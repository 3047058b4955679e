"""Everything that imports rclpy: the nodes (thin adapters over :mod:`selectinfer_ros.core`),
the client facade for the Generate action, behaviour-tree behaviours, the bring-up, small
commands, and the shared rclpy plumbing."""
