"""Measuring tools, not needed on the robot: benchmarks, accuracy evaluation, plots, the
quantization baselines, random-weight models and text metrics (`selectinfer bench`, `eval`,
`eval-choices`). What runs on the robot lives in ``selectinfer_ros.core``."""
