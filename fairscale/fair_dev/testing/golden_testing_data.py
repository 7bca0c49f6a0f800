# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Golden values for the AdaScale tests (inputs of two micro-batches or ranks, expected results).

``adascale_test_data``: each entry has the inputs of micro-batch/rank 0 and 1 (``"input"``, or
``"inputs"`` with one such pair per iteration), the expected gain and the expected gradients.
``corr_mean_test_data``: per-iteration inputs with the expected mean gradient, the Pearson
correlation and the cosine similarity of the two micro-batches.
"""

from typing import Any, Dict, List

adascale_test_data: List[Dict[str, Any]] = [
    {
        "input": [[1.0, 0], [0, 1.0]],
        "expected_gain": 4.0 / 3,
        "expected_grad": [[0.5, 0.5], [0.5, 0.5]],
        "expected_bias_grad": [1.0, 1.0],
    },
    {
        "input": [[1.0, 1.0], [1.0, 1.0]],
        "expected_gain": 1.0000001249999846,
        "expected_grad": [[1.0, 1.0], [1.0, 1.0]],
        "expected_bias_grad": [1.0, 1.0],
    },
    {
        "input": [[-1.0, 1.0], [1.0, -1.0]],
        "expected_gain": 2.0,
        "expected_grad": [[0.0, 0.0], [0.0, 0.0]],
        "expected_bias_grad": [1.0, 1.0],
    },
    {
        "input": [[1.0, 4.0], [5.0, 0.5]],
        "expected_gain": 1.4688796680497926,
        "expected_grad": [[3.0, 2.25], [3.0, 2.25]],
        "expected_bias_grad": [1.0, 1.0],
    },
    {
        "input": [[-0.2, 3.0], [5.0, 0.5]],
        "expected_gain": 1.8472893901708,
        "expected_grad": [[2.4000000953674316, 1.75], [2.4000000953674316, 1.75]],
        "expected_bias_grad": [1.0, 1.0],
    },
    {
        "inputs": [[[-0.2, 3.3], [5.2, 0.7]], [[1.0, 4.0], [3.1, 0.1]]],
        "expected_gain": 1.6720968158031417,
        "expected_grad": [[2.049999952316284, 2.049999952316284], [2.049999952316284, 2.049999952316284]],
        "expected_bias_grad": [1.0, 1.0],
    },
]

corr_mean_test_data: List[Dict[str, Any]] = [
    {
        "inputs": [
            [[1.0, 0.0, 2.0], [2.0, 0.0, 1.0]],
            [[0.0, 1.0, 2.0], [2.0, 1.0, 0]],
            [[3.0, 1.0, 2.0], [2.0, 1.0, -1.0]],
        ],
        "expected_grad": [[1.5, 0.0, 1.5], [1.0, 1.0, 1.0], [2.5, 1.0, 0.5]],
        "expected_corr": [0.5, -1.0, 0.327327],
        "expected_cos_similarity": [float("nan"), 0.8165, 0.8433],
    }
]
