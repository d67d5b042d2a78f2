# An example federation: two models on five engines in four regions of three clouds.
#   cp example.tfvars prod.tfvars   # then edit: images, domain, certificate, networks, projects
#   TF_VAR_hf_token=hf_... terraform apply -var-file=prod.tfvars
# tests/infra renders this site map into the gateway's federation file and starts a gateway with
# it, so what this file describes is what a gateway accepts.

name_prefix = "fedllm"

models = {
  "qwen2.5-7b-instruct" = {
    hf_repo     = "Qwen/Qwen2.5-7B-Instruct"
    hf_revision = "main" # pin a commit hash in production
  }
  "llama-3.1-8b-instruct" = {
    hf_repo     = "meta-llama/Llama-3.1-8B-Instruct" # gated: set TF_VAR_hf_token
    hf_revision = "main"
  }
  # Declared but served by no site: the gateway does not list it.
  "qwen2.5-1.5b-instruct" = {
    hf_repo     = "Qwen/Qwen2.5-1.5B-Instruct"
    hf_revision = "main"
  }
}

sites = {
  # Two L40S engines (aws-use1-1, aws-use1-2) next to the gateway.
  "aws-use1" = {
    cloud           = "aws"
    region          = "us-east-1"
    instance_type   = "g6e.xlarge"
    count           = 2
    model           = "qwen2.5-7b-instruct"
    capacity_weight = 1
    settings = {
      SITE_MAX_NUM_SEQS = "128"
    }
  }
  # One A100 40GB in Europe: somewhat faster than an L40S at decode.
  "gcp-euw4" = {
    cloud           = "gcp"
    region          = "europe-west4"
    zone            = "europe-west4-a"
    instance_type   = "a2-highgpu-1g"
    model           = "qwen2.5-7b-instruct"
    capacity_weight = 1.5
  }
  # One A100 80GB in Sweden serving Llama.
  "azure-swc" = {
    cloud           = "azure"
    region          = "swedencentral"
    instance_type   = "Standard_NC24ads_A100_v4"
    model           = "llama-3.1-8b-instruct"
    capacity_weight = 2
    disk_gb         = 256
    settings = {
      SITE_MAX_NUM_SEQS = "256"
      SITE_POLICY       = "spf"
    }
  }
  "aws-apne1" = {
    cloud         = "aws"
    region        = "ap-northeast-1"
    zone          = "ap-northeast-1a"
    instance_type = "g6e.xlarge"
    model         = "llama-3.1-8b-instruct"
  }
}

site_image = "ghcr.io/example/fedllm-site:0.1.0"

gateway = {
  region          = "us-east-1"
  image           = "123456789012.dkr.ecr.us-east-1.amazonaws.com/fedllm-gateway:0.1.0"
  trainer_image   = "123456789012.dkr.ecr.us-east-1.amazonaws.com/fedllm-trainer:0.1.0"
  domain_name     = "llm.example.com"
  certificate_arn = "arn:aws:acm:us-east-1:123456789012:certificate/00000000-0000-0000-0000-000000000000"
  route53_zone_id = "Z0123456789EXAMPLE"
  routing_policy  = "completion_cost"
  settings = {
    # Sites are up to an ocean away: allow for slower health answers and load reports.
    GATEWAY_CONNECT_TIMEOUT_S   = "5"
    GATEWAY_LOAD_REPORT_STALE_S = "10"
  }
}

# Operators' networks (documentation range here): /admin and /metrics, and where Terraform runs.
admin_cidrs = ["203.0.113.0/24"]

gcp_project           = "example-fedllm"
azure_subscription_id = "00000000-0000-0000-0000-000000000000"

# A vLLM deployment already running elsewhere, joined as a site of kind openai
# (docs/external-engines.md); its key file is placed next to the federation file on the gateway.
openai_sites = {
  "vllm-onprem-fra" = {
    cloud           = "onprem"
    region          = "eu-central-fra"
    model           = "qwen2.5-7b-instruct"
    base_url        = "https://vllm-fra.internal.example:8000/v1"
    engine_model    = "Qwen/Qwen2.5-7B-Instruct"
    api_key_file    = "secrets/vllm-onprem-fra.key"
    metrics_url     = "https://vllm-fra.internal.example:8000/metrics"
    metrics_dialect = "vllm"
  }
}
