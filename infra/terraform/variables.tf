variable "name_prefix" {
  description = "Deployment name: prefixes every resource and names the certificates' organization."
  type        = string
  default     = "fedllm"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,14}$", var.name_prefix))
    error_message = "name_prefix: 2-15 characters, lowercase letters, digits and '-', starting with a letter."
  }
}

variable "models" {
  description = "Models the federation serves, by the name clients request (the OpenAI `model` field): where the weights and tokenizer come from, a Hugging Face repository at a revision (pin a commit hash: the gateway's tokenizer and every site's weights must come from the same one)."
  type = map(object({
    hf_repo     = string
    hf_revision = string
  }))
  validation {
    condition     = length(var.models) > 0 && alltrue([for name in keys(var.models) : can(regex("^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", name))])
    error_message = "models: at least one; names are 1-128 of letters, digits, '.', '_' and '-'."
  }
  validation {
    condition     = alltrue([for model in values(var.models) : can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", model.hf_repo)) && can(regex("^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", model.hf_revision))])
    error_message = "models: hf_repo is 'owner/name'; hf_revision a commit hash (recommended), tag or branch."
  }
}

variable "sites" {
  description = <<-EOT
    The federation's sites by name. Each site is `count` identical engines (one GPU instance
    each) named <site> or, for count > 1, <site>-1 ... <site>-<count>:
      cloud           aws | gcp | azure
      region          the cloud's region (us-east-1, europe-west4, swedencentral)
      zone            AWS availability zone or Azure zone ("1"); required on GCP; optional elsewhere
      instance_type   GPU instance type (g6e.xlarge, a2-highgpu-1g, Standard_NC24ads_A100_v4)
      count           engines in the site (default 1)
      model           a key of var.models
      capacity_weight each engine's share of token load relative to the others (default 1)
      disk_gb         boot disk: OS, container image, weights (default 200)
      image           site container image for this site only (default var.site_image)
      settings        SITE_* engine settings (site_engine/settings.py), e.g. SITE_MAX_NUM_SEQS
      drain           true: keep the engines running but take them out of the gateway's
                      federation (the gateway is rolled without them); remove the entry later
  EOT
  type = map(object({
    cloud           = string
    region          = string
    zone            = optional(string)
    instance_type   = string
    count           = optional(number, 1)
    model           = string
    capacity_weight = optional(number, 1)
    disk_gb         = optional(number, 200)
    image           = optional(string)
    settings        = optional(map(string), {})
    drain           = optional(bool, false)
  }))
  validation {
    condition     = length(var.sites) > 0 && alltrue([for name in keys(var.sites) : can(regex("^[a-z][a-z0-9-]{0,40}$", name))])
    error_message = "sites: at least one; names are lowercase letters, digits and '-', starting with a letter, at most 41."
  }
  validation {
    condition     = anytrue([for site in values(var.sites) : !site.drain])
    error_message = "sites: at least one site must not be draining."
  }
  validation {
    condition     = alltrue([for site in values(var.sites) : contains(["aws", "gcp", "azure"], site.cloud)])
    error_message = "sites: cloud must be aws, gcp or azure."
  }
  validation {
    condition     = alltrue([for site in values(var.sites) : contains(keys(var.models), site.model)])
    error_message = "sites: model must be one of the keys of var.models."
  }
  validation {
    condition     = alltrue([for site in values(var.sites) : floor(site.count) == site.count && site.count >= 1 && site.count <= 16])
    error_message = "sites: count must be a whole number from 1 to 16."
  }
  validation {
    condition     = alltrue([for site in values(var.sites) : site.capacity_weight > 0 && site.capacity_weight <= 1000])
    error_message = "sites: capacity_weight must be greater than 0 (and at most 1000)."
  }
  validation {
    condition     = alltrue([for site in values(var.sites) : site.disk_gb >= 100 && site.disk_gb <= 16000])
    error_message = "sites: disk_gb must be between 100 and 16000."
  }
  validation {
    condition = alltrue([for site in values(var.sites) : can(regex(lookup({
      aws   = "^(g[4-9][a-z]*|p[3-9][a-z]*)\\.[0-9a-z]+$"
      gcp   = "^(a2|a3|a4|g2|g4)-[a-z0-9-]+$"
      azure = "^Standard_N[A-Za-z0-9_]+$"
    }, site.cloud, "^$"), site.instance_type))])
    error_message = "sites: instance_type must be a GPU type of the site's cloud: aws g4dn/g5/g6/g6e/p4d/p5..., gcp accelerator-optimized a2/a3/a4/g2/g4, azure Standard_N*."
  }
  validation {
    condition = alltrue([for site in values(var.sites) : (
      site.cloud == "gcp" ? can(regex("^${site.region}-[a-z]$", coalesce(site.zone, "-"))) :
      site.cloud == "aws" ? site.zone == null || can(regex("^${site.region}[a-z]$", coalesce(site.zone, "-"))) :
      site.zone == null || contains(["1", "2", "3"], coalesce(site.zone, "-"))
    )])
    error_message = "sites: zone is required on gcp (<region>-a); on aws it is <region><letter>, on azure \"1\", \"2\" or \"3\"; both optional."
  }
  validation {
    condition     = alltrue([for site in values(var.sites) : alltrue([for key, value in site.settings : contains(["SITE_DEVICE", "SITE_DTYPE", "SITE_MAX_NUM_SEQS", "SITE_MAX_NUM_BATCHED_TOKENS", "SITE_BLOCK_SIZE", "SITE_KV_CACHE_MIB", "SITE_POLICY", "SITE_LOAD_REPORT_INTERVAL_MS", "SITE_TORCH_THREADS", "SITE_MAX_QUEUED_REQUESTS"], key) && !can(regex("[\n\r'\"]", value))])])
    error_message = "sites: settings keys are engine settings (SITE_DEVICE, SITE_DTYPE, SITE_MAX_NUM_SEQS, SITE_MAX_NUM_BATCHED_TOKENS, SITE_BLOCK_SIZE, SITE_KV_CACHE_MIB, SITE_POLICY, SITE_LOAD_REPORT_INTERVAL_MS, SITE_TORCH_THREADS, SITE_MAX_QUEUED_REQUESTS) with single-line values; names, model and port come from the site map."
  }
  validation {
    condition = length(distinct(flatten([
      for name, site in var.sites : site.count == 1 ? [name] : [for i in range(site.count) : "${name}-${i + 1}"]
    ]))) == sum([for site in values(var.sites) : site.count])
    error_message = "sites: two engines would get the same name (a site named like another's numbered engine, e.g. 'a-1' next to 'a' with count 2)."
  }
}

variable "site_image" {
  description = "Site engine container image (docker/site.Dockerfile) every site runs unless it names its own; pin by digest. It must be pullable from every cloud in the site map."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$", var.site_image))
    error_message = "site_image must be a registry reference with a tag or digest, e.g. ghcr.io/acme/fedllm-site@sha256:..."
  }
}

variable "gateway" {
  description = <<-EOT
    The gateway (AWS ECS Fargate behind an HTTPS load balancer):
      region          AWS region of the gateway and its database
      image           gateway container image (docker/gateway.Dockerfile); pin by digest
      trainer_image   image of the one-off retraining task (the same Dockerfile, --target trainer)
      domain_name     public host name of the API
      certificate_arn ACM certificate for domain_name, in region
      route53_zone_id hosted zone to create domain_name in (null: point a CNAME yourself)
      routing_policy  round_robin | least_requests | least_tokens | least_tokens_guess | mico |
                      least_latency | completion_cost | prefix_affinity | dynamo_cost
                      (default completion_cost, the gateway's: docs/routing.md)
      cpu, memory     task size (default 2048 CPU units, 8192 MiB)
      vpc_cidr        the gateway VPC (default 10.40.0.0/16)
      availability_zones  the two or more zones of the gateway VPC (default <region>a, <region>b)
      public_cidrs    who may call the API (default everyone)
      predictor_dir   a length-predictor artifact on the predictor file system to start from
                      (GATEWAY_PREDICTOR_DIR), e.g. /srv/fedllm/predictor/initial; null: fallback mode
      drain_seconds   how long a replaced gateway task finishes its in-flight requests (default 600)
      settings        further GATEWAY_* settings (gateway/settings.py)
  EOT
  type = object({
    region             = string
    image              = string
    trainer_image      = string
    domain_name        = string
    certificate_arn    = string
    route53_zone_id    = optional(string)
    routing_policy     = optional(string, "completion_cost")
    cpu                = optional(number, 2048)
    memory             = optional(number, 8192)
    vpc_cidr           = optional(string, "10.40.0.0/16")
    availability_zones = optional(list(string))
    public_cidrs       = optional(list(string), ["0.0.0.0/0"])
    predictor_dir      = optional(string)
    drain_seconds      = optional(number, 600)
    settings           = optional(map(string), {})
  })
  validation {
    condition     = contains(["round_robin", "least_requests", "least_tokens", "least_tokens_guess", "mico", "least_latency", "completion_cost", "prefix_affinity", "dynamo_cost"], var.gateway.routing_policy)
    error_message = "gateway.routing_policy must be round_robin, least_requests, least_tokens, least_tokens_guess, mico, least_latency, completion_cost, prefix_affinity or dynamo_cost."
  }
  validation {
    condition     = alltrue([for key, value in var.gateway.settings : can(regex("^GATEWAY_[A-Z0-9_]+$", key)) && !contains(["GATEWAY_DATABASE_URL", "GATEWAY_HOST", "GATEWAY_PORT", "GATEWAY_FEDERATION_FILE", "GATEWAY_ROUTING_POLICY", "GATEWAY_PREDICTOR_DIR", "GATEWAY_ADMIN_TOKEN", "GATEWAY_SITE_TLS_CA", "GATEWAY_SITE_TLS_CERT", "GATEWAY_SITE_TLS_KEY", "GATEWAY_REQUIRE_API_KEYS", "GATEWAY_ALLOW_OPEN_ACCESS"], key)])
    error_message = "gateway.settings: GATEWAY_* names other than those the deployment sets itself (database URL, host, port, federation file, routing policy, predictor dir, admin token, site TLS files, API keys required)."
  }
  validation {
    condition     = var.gateway.predictor_dir == null || startswith(coalesce(var.gateway.predictor_dir, "-"), "/srv/fedllm/predictor/")
    error_message = "gateway.predictor_dir must lie on the predictor file system: /srv/fedllm/predictor/<name>."
  }
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.gateway.region)) && can(cidrhost(var.gateway.vpc_cidr, 0))
    error_message = "gateway: region must be an AWS region name; vpc_cidr an IPv4 CIDR."
  }
  validation {
    condition     = var.gateway.availability_zones == null || (length(coalesce(var.gateway.availability_zones, [])) >= 2 && alltrue([for zone in coalesce(var.gateway.availability_zones, []) : startswith(zone, var.gateway.region)]))
    error_message = "gateway.availability_zones: at least two zones of gateway.region (the load balancer and the database need two)."
  }
}

variable "database" {
  description = "The gateway's PostgreSQL on RDS: instance class, major version, storage, Multi-AZ, days of backups. Deletion protection is always on: turn it off in modules/aws_gateway deliberately to delete the database."
  type = object({
    instance_class        = optional(string, "db.m7g.large")
    engine_version        = optional(string, "16")
    allocated_storage_gb  = optional(number, 100)
    max_storage_gb        = optional(number, 1000)
    multi_az              = optional(bool, true)
    backup_retention_days = optional(number, 14)
  })
  default = {}
  validation {
    condition     = can(regex("^1[5-9]", var.database.engine_version)) && var.database.backup_retention_days >= 1 && var.database.backup_retention_days <= 35
    error_message = "database: PostgreSQL 15 or later, 1 to 35 days of backups."
  }
}

variable "admin_cidrs" {
  description = "Operators' networks (1-4 CIDRs): the only sources the load balancer forwards /admin and /metrics from, and, with the sites' Azure Key Vaults, the addresses Terraform runs from."
  type        = list(string)
  validation {
    condition     = length(var.admin_cidrs) >= 1 && length(var.admin_cidrs) <= 4 && alltrue([for c in var.admin_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "admin_cidrs: 1 to 4 IPv4 CIDRs, never 0.0.0.0/0."
  }
}

variable "grpc_port" {
  description = "Port every site engine serves gRPC on (reachable only from the gateway's egress addresses)."
  type        = number
  default     = 50051
  validation {
    condition     = var.grpc_port >= 1024 && var.grpc_port <= 65535
    error_message = "grpc_port must be between 1024 and 65535."
  }
}

variable "site_vpc_cidr" {
  description = "Address range of each site's own network (sites never peer, so every site may reuse it)."
  type        = string
  default     = "10.50.0.0/16"
  validation {
    condition     = can(cidrhost(var.site_vpc_cidr, 0)) && can(regex("/(1[0-8]|[0-9])$", var.site_vpc_cidr))
    error_message = "site_vpc_cidr must be an IPv4 CIDR of /18 or larger."
  }
}

variable "gcp_project" {
  description = "GCP project of the gcp sites; required when the site map has one."
  type        = string
  default     = null
  validation {
    condition     = var.gcp_project != null || alltrue([for site in values(var.sites) : site.cloud != "gcp"])
    error_message = "gcp_project is required when a site runs on gcp."
  }
}

variable "azure_subscription_id" {
  description = "Azure subscription of the azure sites; required when the site map has one."
  type        = string
  default     = null
  validation {
    condition     = var.azure_subscription_id != null || alltrue([for site in values(var.sites) : site.cloud != "azure"])
    error_message = "azure_subscription_id is required when a site runs on azure."
  }
}

variable "hf_token" {
  description = "Hugging Face token for gated or private models (e.g. Llama); stored only in the clouds' secret managers. null for public models."
  type        = string
  default     = null
  sensitive   = true
  validation {
    condition     = var.hf_token == null || can(regex("^hf_[A-Za-z0-9]{20,}$", var.hf_token))
    error_message = "hf_token must be a Hugging Face access token (hf_...) or null."
  }
}

variable "aws_ami_ssm_parameter" {
  description = "Public SSM parameter of the AWS sites' GPU AMI (NVIDIA driver, Docker, NVIDIA container toolkit)."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
  validation {
    condition     = startswith(var.aws_ami_ssm_parameter, "/")
    error_message = "aws_ami_ssm_parameter must be an SSM parameter path."
  }
}

variable "gcp_boot_image" {
  description = "Boot image of the GCP sites: any image with the NVIDIA driver (Docker and the container toolkit are installed at boot if missing)."
  type        = string
  default     = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
  validation {
    condition     = can(regex("^projects/[a-z0-9-]+/global/images/(family/)?[a-z0-9-]+$", var.gcp_boot_image))
    error_message = "gcp_boot_image must be projects/<project>/global/images/[family/]<name>."
  }
}

variable "azure_source_image" {
  description = "Marketplace image of the Azure sites: the Azure HPC image carries the NVIDIA driver, Docker and the NVIDIA container runtime."
  type = object({
    publisher = string
    offer     = string
    sku       = string
    version   = string
  })
  default = {
    publisher = "microsoft-dsvm"
    offer     = "ubuntu-hpc"
    sku       = "2204"
    version   = "latest"
  }
  validation {
    condition     = alltrue([for part in values(var.azure_source_image) : length(part) > 0])
    error_message = "azure_source_image: publisher, offer, sku and version must all be set."
  }
}

variable "tls_validity_days" {
  description = "Lifetime of the gateway's and the engines' mTLS certificates; an apply in their last 30 days re-issues them."
  type        = number
  default     = 365
  validation {
    condition     = var.tls_validity_days >= 60 && var.tls_validity_days <= 825
    error_message = "tls_validity_days must be between 60 and 825."
  }
}

variable "log_retention_days" {
  description = "Days the gateway logs and the VPC flow logs are kept."
  type        = number
  default     = 365
  validation {
    condition     = contains([90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch Logs retention value of at least 90 (e.g. 365)."
  }
}

variable "tags" {
  description = "Tags (AWS, Azure) and labels (GCP, lower-cased) added to every resource."
  type        = map(string)
  default     = {}
  validation {
    condition     = alltrue([for key, value in var.tags : length(key) >= 1 && length(key) <= 63 && length(value) <= 63])
    error_message = "tags: keys of 1-63 and values of at most 63 characters (GCP's label limits)."
  }
}

variable "openai_sites" {
  description = <<-EOT
    OpenAI-compatible engines this configuration does not deploy (vLLM, SGLang, TGI, already
    running), joined to the federation as sites of kind openai (docs/external-engines.md):
      cloud, region    where the engine runs (labels for routing and the dashboard)
      model            a key of var.models
      base_url         the engine's API root, ending in /v1
      engine_model     the model's name at the engine (default: the model's key)
      api_key_file     path of the engine's API key on the gateway, relative to the federation
                       file (the secret itself stays out of Terraform state)
      metrics_url      its Prometheus page, with metrics_dialect vllm | sglang | tgi
      max_model_len, max_num_seqs, kv_capacity_tokens   what the engine does not say itself
      capacity_weight  its share of token load relative to the other sites (default 1)
  EOT
  type = map(object({
    cloud              = string
    region             = string
    model              = string
    base_url           = string
    engine_model       = optional(string)
    api_key_file       = optional(string)
    metrics_url        = optional(string)
    metrics_dialect    = optional(string, "none")
    max_model_len      = optional(number)
    max_num_seqs       = optional(number)
    kv_capacity_tokens = optional(number)
    capacity_weight    = optional(number, 1)
  }))
  default = {}
  validation {
    condition = alltrue([
      for site in values(var.openai_sites) : contains(["vllm", "sglang", "tgi", "none"], site.metrics_dialect) && startswith(site.base_url, "http") && ((site.metrics_url == null) == (site.metrics_dialect == "none"))
    ])
    error_message = "openai_sites: base_url must be an http(s) URL; metrics_url and a metrics_dialect (vllm, sglang, tgi) go together."
  }
}
