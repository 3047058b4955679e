.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	bash -c 'set +u; source scripts/env.sh && .venv/bin/python -m selectinfer_ros.ros.demo'

test:
	bash scripts/run_tests.sh
