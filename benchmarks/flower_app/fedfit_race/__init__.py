"""FedFit's FedAvg workload as a Flower App (ServerApp and ClientApp), raced by ``benchmarks/flower_race.py``."""
