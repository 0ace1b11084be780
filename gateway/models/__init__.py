"""The models served: the models file, engines built and started on demand, replicas and routing."""
