"""rolloutpipe: pipelined on-policy RL with verifiable rewards for language models, in JAX."""

from setuptools import find_packages, setup

# Lower bounds are the versions the test suite was run with; no upper pins.
# Python >= 3.11 because jax, flax, grain, orbax and numpy at these versions require it.
INSTALL_REQUIRES = [
    "jax>=0.10.2",
    "flax>=0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "grain>=0.2.18",
    "absl-py>=2.5.1",
    "ml_collections>=1.1.0",
    "numpy>=2.4",
    "ml_dtypes>=0.6.0",
    "safetensors>=0.8.0",
    "tokenizers>=0.23.3",
    "jinja2>=3.1.6",
    "tqdm>=4.70",
    "tensorboardX>=2.6.5",
    "matplotlib>=3.11",
    "scipy>=1.10",  # rl/elastic/stage.py: non-negative least squares fits of stage-time models
    "math-verify>=0.9.0",  # symbolic checks of math answers that are not one number
    # config.runtime="ray": the learner and sampler replicas as actors (rl/runtime/ray_runtime.py)
    "ray>=2.60.0",
]

EXTRAS = {
    "test": [
        "pytest>=9.2",
        "pytest-xdist>=3.8",  # pytest.ini runs the suite on 2 workers
        "hypothesis>=6.170",
        # Parity tests build tiny random Hugging Face models on the CPU. torch is pinned exactly:
        # 2.13.0 is a CPU build, while a looser spec resolves to a multi-GB CUDA build.
        "torch==2.13.0",
        "transformers>=5.24",
        "wandb>=0.31",  # tests/rl/test_tracking.py: offline W&B runs
        # tests/rl/tasks/test_hf_datasets.py: save_to_disk directories, parquet and arrow files
        "datasets>=5.2",
        "pyarrow>=26",
    ],
    "cuda": ["jax[cuda12]>=0.10.2"],
    "tpu": ["jax[tpu]>=0.10.2"],
    # config.log.wandb=True: metrics, config and results to Weights & Biases (rl/tracking.py)
    "wandb": ["wandb>=0.31"],
    # sampler/jetstream_adapter.py only. Optional and heavy: it pulls seqio and so TensorFlow;
    # nothing else in the library imports it.
    "jetstream": ["google-jetstream>=0.2.2"],
    # config.data paths that are parquet / arrow files or datasets' save_to_disk directories
    # (rl/tasks/hf_datasets.py); JSONL data needs neither.
    "datasets": ["datasets>=5.2", "pyarrow>=26"],
}

setup(
    name="rolloutpipe",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(
        include=[
            "rl",
            "rl.*",
            "sampler",
            "sampler.*",
            "learner",
            "learner.*",
            "configs",
            "configs.*",
            "launch",
            "launch.*",
        ]
    ),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
