"""How a suite run happens: the pytest plugin, the suite run, the driver, specs, prompts, the
backend registry, case timeouts and interrupt handling."""
