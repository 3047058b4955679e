"""ament_python package selectinfer_ros (also installable with plain pip)."""
import os
from glob import glob

from setuptools import find_packages, setup

package_name = 'selectinfer_ros'
here = os.path.dirname(os.path.abspath(__file__))


def tree_data_files(top, dest_root):
    """(install dir, [files]) pairs for every file under ``top``, keeping the tree."""
    pairs = []
    base = os.path.join(here, top)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames
                             if not d.startswith('.') and d != '__pycache__')
        files = sorted(
            os.path.relpath(os.path.join(dirpath, f), here)
            for f in filenames if not f.startswith('.'))
        if files:
            rel = os.path.relpath(dirpath, here)
            pairs.append((os.path.join(dest_root, rel), files))
    return pairs


share = os.path.join('share', package_name)
data_files = [
    ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
    (share, ['package.xml']),
    (os.path.join(share, 'launch'), sorted(glob('launch/*.py'))),
    (os.path.join(share, 'config'), sorted(glob('config/*.yaml'))),
] + tree_data_files('profiles', share)

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(exclude=['test', 'test.*']),
    package_data={package_name: ['data/*/*.jsonl', 'data/examples/*', 'core/format/kernels/*.c',
                                'core/format/kernels/*.h']},
    data_files=data_files,
    install_requires=[
        'setuptools',
        # torch is deliberately not listed: robots use NVIDIA's own wheels.
        'numpy',
        'pyyaml',
        'safetensors',
        'transformers',
        'py_trees',  # selectinfer_ros.ros.behaviours only
    ],
    zip_safe=False,
    maintainer='selectinfer developers',
    maintainer_email='dev@selectinfer.example.com',
    description='ROS 2 nodes serving an LLM with selective neuron loading.',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'selectinfer = selectinfer_ros.cli:main',
            'selectinfer_node = selectinfer_ros.ros.nodes.inference_node:main',
            'profile_manager = selectinfer_ros.ros.nodes.profile_manager:main',
            'selectinfer_bringup = selectinfer_ros.ros.bringup:main',
            'selectinfer_demo = selectinfer_ros.ros.demo:main',
            'selectinfer_generate = selectinfer_ros.ros.tools.generate:main',
            'selectinfer_switch = selectinfer_ros.ros.tools.switch:main',
            'selectinfer_diagnostics = selectinfer_ros.ros.tools.diagnostics:main',
            'selectinfer_bt_patrol = selectinfer_ros.ros.examples.bt_patrol:main',
        ],
    },
)
