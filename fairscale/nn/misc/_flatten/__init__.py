# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Private machinery of :mod:`fairscale.nn.misc.flatten_params_wrapper` (one concept per module).

* ``flat_parameter``: :class:`FlatParameter`, the data model of one flattened group.
* ``grouping``: turning ``param_list`` into validated groups and locating every owner of each parameter.
* ``module_attrs``: setting, saving and removing the view attributes of the wrapped modules.
* ``state_dict_hooks``: the key (and ``_metadata``) rewriting done by the state-dict post hook and the load pre hook.
* ``unflatten_context``: what ``unflatten_params()`` hands out and takes back on exit (rebinds, ``requires_grad``,
  conversions), and copies made inside it.
* ``view_release``: detaching the modules' views from their graph when the wrapper is freed, so that a dropped
  wrapper's flat parameters and modules are freed too.
"""
