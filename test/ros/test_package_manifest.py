"""package.xml declares every ROS package the code imports, so `rosdep install` brings them."""
import ast
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROS_PACKAGES = {'rclpy', 'rcl_interfaces', 'lifecycle_msgs', 'action_msgs', 'builtin_interfaces',
                'diagnostic_msgs', 'selectinfer_msgs', 'ament_index_python', 'launch', 'launch_ros',
                'std_msgs', 'geometry_msgs', 'py_trees_ros'}
ROSDEP_KEYS = {'yaml': 'python3-yaml', 'numpy': 'python3-numpy', 'tqdm': 'python3-tqdm',
               'py_trees': 'python3-py-trees'}


def _imported_top_levels():
    names = set()
    for path in [*(ROOT / 'selectinfer_ros').rglob('*.py'), *(ROOT / 'launch').glob('*.py')]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split('.')[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split('.')[0])
    return names


def test_package_xml_declares_what_the_code_imports():
    root = ET.parse(ROOT / 'package.xml').getroot()
    deps = {e.text for e in root if e.tag in ('exec_depend', 'depend')}
    imported = _imported_top_levels()
    ros_used = imported & ROS_PACKAGES
    assert ros_used <= deps, f'missing exec_depend: {sorted(ros_used - deps)}'
    for module, key in ROSDEP_KEYS.items():
        if module in imported:
            assert key in deps, f'{module} is imported: exec_depend {key} missing'
    declared_ros = deps & ROS_PACKAGES
    assert declared_ros <= ros_used, f'declared but never imported: {sorted(declared_ros - ros_used)}'
