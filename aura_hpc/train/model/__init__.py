"""Our GPT-2 and what knows the model alone: building it from config, the loss, meta-device initialisation."""
