# The gateway (AWS: ECS Fargate, RDS PostgreSQL, an HTTPS load balancer) and every site of
# var.sites, each in its own network of its cloud. Sites admit only the gateway's NAT addresses on
# their gRPC port; both ends hold certificates from one private CA (modules/pki). The gateway is
# rendered the site list (federation.tf) rather than sites registering themselves.

locals {
  tags = merge(var.tags, { "fedllm-deployment" = var.name_prefix, "managed-by" = "terraform" })
  # GCP labels: lowercase letters, digits, '_' and '-' only.
  labels = { for key, value in local.tags : lower(replace(key, "/[^A-Za-z0-9_-]/", "_")) => lower(replace(value, "/[^A-Za-z0-9_-]/", "_")) }

  aws_sites   = { for name, site in var.sites : name => site if site.cloud == "aws" }
  gcp_sites   = { for name, site in var.sites : name => site if site.cloud == "gcp" }
  azure_sites = { for name, site in var.sites : name => site if site.cloud == "azure" }

  site_models = {
    for name, site in var.sites : name => {
      name        = site.model
      hf_repo     = var.models[site.model].hf_repo
      hf_revision = var.models[site.model].hf_revision
    }
  }
}

module "gateway_kms" {
  source = "./modules/aws_kms_key"
  name   = "${var.name_prefix}-gateway"
  region = var.gateway.region
  tags   = local.tags
}

module "gateway_network" {
  source               = "./modules/aws_network"
  name                 = "${var.name_prefix}-gateway"
  region               = var.gateway.region
  cidr                 = var.gateway.vpc_cidr
  availability_zones   = coalesce(var.gateway.availability_zones, ["${var.gateway.region}a", "${var.gateway.region}b"])
  private_subnets      = true
  flow_log_kms_key_arn = module.gateway_kms.arn
  log_retention_days   = var.log_retention_days
  tags                 = local.tags
}

module "pki" {
  source             = "./modules/pki"
  name_prefix        = var.name_prefix
  ca_validity_days   = 3650
  leaf_validity_days = var.tls_validity_days
}

module "aws_site" {
  source                 = "./modules/aws_site"
  for_each               = local.aws_sites
  name                   = each.key
  name_prefix            = var.name_prefix
  region                 = each.value.region
  zone                   = each.value.zone
  instance_type          = each.value.instance_type
  instance_names         = local.instance_names[each.key]
  model                  = local.site_models[each.key]
  image                  = coalesce(each.value.image, var.site_image)
  settings               = each.value.settings
  grpc_port              = var.grpc_port
  gateway_cidrs          = module.gateway_network.egress_cidrs
  vpc_cidr               = var.site_vpc_cidr
  disk_gb                = each.value.disk_gb
  ami_ssm_parameter      = var.aws_ami_ssm_parameter
  tls_ca_cert_pem        = module.pki.ca_cert_pem
  tls_ca_private_key_pem = module.pki.ca_private_key_pem
  tls_validity_days      = var.tls_validity_days
  hf_token               = var.hf_token
  log_retention_days     = var.log_retention_days
  tags                   = local.tags
}

module "gcp_site" {
  source                 = "./modules/gcp_site"
  for_each               = local.gcp_sites
  name                   = each.key
  name_prefix            = var.name_prefix
  project                = var.gcp_project
  region                 = each.value.region
  zone                   = each.value.zone
  machine_type           = each.value.instance_type
  instance_names         = local.instance_names[each.key]
  model                  = local.site_models[each.key]
  image                  = coalesce(each.value.image, var.site_image)
  settings               = each.value.settings
  grpc_port              = var.grpc_port
  gateway_cidrs          = module.gateway_network.egress_cidrs
  subnet_cidr            = cidrsubnet(var.site_vpc_cidr, 4, 0)
  disk_gb                = each.value.disk_gb
  boot_image             = var.gcp_boot_image
  boot_disk_type         = can(regex("^(a4|a3-ultragpu)", each.value.instance_type)) ? "hyperdisk-balanced" : "pd-balanced"
  tls_ca_cert_pem        = module.pki.ca_cert_pem
  tls_ca_private_key_pem = module.pki.ca_private_key_pem
  tls_validity_days      = var.tls_validity_days
  hf_token               = var.hf_token
  labels                 = local.labels
}

module "azure_site" {
  source                 = "./modules/azure_site"
  for_each               = local.azure_sites
  name                   = each.key
  name_prefix            = var.name_prefix
  location               = each.value.region
  zone                   = each.value.zone
  vm_size                = each.value.instance_type
  instance_names         = local.instance_names[each.key]
  model                  = local.site_models[each.key]
  image                  = coalesce(each.value.image, var.site_image)
  settings               = each.value.settings
  grpc_port              = var.grpc_port
  gateway_cidrs          = module.gateway_network.egress_cidrs
  vpc_cidr               = var.site_vpc_cidr
  disk_gb                = each.value.disk_gb
  source_image           = var.azure_source_image
  operator_cidrs         = var.admin_cidrs
  tls_ca_cert_pem        = module.pki.ca_cert_pem
  tls_ca_private_key_pem = module.pki.ca_private_key_pem
  tls_validity_days      = var.tls_validity_days
  hf_token               = var.hf_token
  tags                   = local.tags
}

module "gateway" {
  source             = "./modules/aws_gateway"
  name_prefix        = var.name_prefix
  region             = var.gateway.region
  vpc_id             = module.gateway_network.vpc_id
  public_subnet_ids  = module.gateway_network.public_subnet_ids
  private_subnet_ids = module.gateway_network.private_subnet_ids
  kms_key_arn        = module.gateway_kms.arn
  image              = var.gateway.image
  trainer_image      = var.gateway.trainer_image
  cpu                = var.gateway.cpu
  memory             = var.gateway.memory
  environment        = local.gateway_environment
  domain_name        = var.gateway.domain_name
  certificate_arn    = var.gateway.certificate_arn
  route53_zone_id    = var.gateway.route53_zone_id
  public_cidrs       = var.gateway.public_cidrs
  admin_cidrs        = var.admin_cidrs
  site_cidrs         = [for address in flatten(values(local.site_public_ips)) : "${address}/32"]
  grpc_port          = var.grpc_port
  tls = {
    ca_cert_pem     = module.pki.ca_cert_pem
    cert_pem        = module.pki.gateway_cert_pem
    private_key_pem = module.pki.gateway_private_key_pem
  }
  hf_token           = var.hf_token
  database           = var.database
  drain_seconds      = var.gateway.drain_seconds
  log_retention_days = var.log_retention_days
  tags               = local.tags
}
