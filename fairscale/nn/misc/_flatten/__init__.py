# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Private machinery of :mod:`fairscale.nn.misc.flatten_params_wrapper` (one concept per module).

* ``flat_parameter``: :class:`FlatParameter`, the data model of one flattened group.
* ``grouping``: turning ``param_list`` into validated groups and locating every owner of each parameter.
* ``state_dict_hooks``: the key rewriting done by the state-dict post hook and the load pre hook.
* ``view_release``: detaching the modules' views from their graph when the wrapper is freed, so that a dropped
  wrapper's flat parameters and modules are freed too.
"""
