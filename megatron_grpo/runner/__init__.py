"""The GRPO runner and the `megatron-grpo` command line, on top of the plugin.

- the command line: `cli` (dispatch), `launcher` (torchrun's agent in-process), `train_cli`, `plan_cli`,
  `report_cli`, `helptext`;
- the config: `config` (the typed YAML config, `load_config`, `ConfigError`), `config_files` (YAML and `defaults:`),
  `nemo_rl_config` (a NeMo-RL config read for `plan`), and the adapters to the plugin's parameter objects,
  `plan_inputs` and `plugin_params`;
- the job: `tasks`, `rollout`, `rollout_queue`, `advantages`, `shaping`, `loop`, `checkpoint`, `checkpoint_dir`,
  `run_start`, `lifetime`, `statistics`, `reporting`, `tensorboard_log`.

Nothing in the plugin (`ops`, `loss`, `scheduler`, `megatron`) imports this package. It reaches Megatron-Core only
through `megatron_grpo.megatron`, and only after it has validated its input.
"""
