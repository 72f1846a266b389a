"""HF Trainer glue shared by the experiments: one recipe (`recipe.train_model`) over the checkpointing Trainer
(`trainer`), the stage settings (`config`), where and in which precision a stage runs (`device`) and their
``TrainingArguments`` (`arguments`), callbacks, reporting integrations (`reporting`) and SCALE-Route's tau calibration
(`route_calibration`)."""
