# A GPU site on AWS: its own VPC, one EC2 instance per engine with a fixed public address that
# only the gateway's egress addresses may reach (gRPC port only; no SSH: Session Manager instead),
# a server certificate per engine and a secret bundle per engine that only its instance can read.

locals {
  # Instance names are unique within the federation; resource names add the deployment prefix.
  instances = { for index, name in var.instance_names : name => index }
  zone      = coalesce(var.zone, try(sort(data.aws_ec2_instance_type_offerings.zones.locations)[0], null))
}

data "aws_partition" "current" {}

data "aws_ec2_instance_type_offerings" "zones" {
  region        = var.region
  location_type = "availability-zone"
  filter {
    name   = "instance-type"
    values = [var.instance_type]
  }
}

data "aws_ssm_parameter" "ami" {
  region = var.region
  name   = var.ami_ssm_parameter
}

module "kms" {
  source = "../aws_kms_key"
  name   = "${var.name_prefix}-${var.name}"
  region = var.region
  tags   = var.tags
}

module "network" {
  source               = "../aws_network"
  name                 = "${var.name_prefix}-${var.name}"
  region               = var.region
  cidr                 = var.vpc_cidr
  availability_zones   = [local.zone]
  private_subnets      = false
  flow_log_kms_key_arn = module.kms.arn
  log_retention_days   = var.log_retention_days
  tags                 = var.tags
}

resource "aws_security_group" "site" {
  region      = var.region
  name_prefix = "${var.name_prefix}-${var.name}-"
  description = "fedllm site ${var.name}: gRPC from the gateway only"
  vpc_id      = module.network.vpc_id
  tags        = merge(var.tags, { Name = "${var.name_prefix}-${var.name}" })
  lifecycle {
    create_before_destroy = true
  }
}

# count, not for_each: the gateway's NAT addresses are only known after they are created.
resource "aws_vpc_security_group_ingress_rule" "grpc_from_gateway" {
  count             = length(var.gateway_cidrs)
  region            = var.region
  security_group_id = aws_security_group.site.id
  description       = "gRPC from the gateway's egress addresses"
  ip_protocol       = "tcp"
  from_port         = var.grpc_port
  to_port           = var.grpc_port
  cidr_ipv4         = var.gateway_cidrs[count.index]
}

# Outbound: HTTPS to the container registry, Hugging Face (weights) and AWS APIs (secrets, Session
# Manager); HTTP to the Ubuntu mirrors (signed packages) in case the GPU container runtime must be
# installed. Amazon DNS and time sync are not subject to security groups.
resource "aws_vpc_security_group_egress_rule" "web" {
  for_each          = toset(["80", "443"])
  region            = var.region
  security_group_id = aws_security_group.site.id
  description       = "Port ${each.value} to registries, package mirrors, Hugging Face and AWS APIs"
  ip_protocol       = "tcp"
  from_port         = tonumber(each.value)
  to_port           = tonumber(each.value)
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_eip" "engine" {
  for_each = local.instances
  region   = var.region
  domain   = "vpc"
  tags     = merge(var.tags, { Name = "${var.name_prefix}-${each.key}" })
}

# One server certificate per engine, naming its fixed address and its federation name.
resource "tls_private_key" "engine" {
  for_each    = local.instances
  algorithm   = "ECDSA"
  ecdsa_curve = "P256"
}

resource "tls_cert_request" "engine" {
  for_each        = local.instances
  private_key_pem = tls_private_key.engine[each.key].private_key_pem
  dns_names       = [each.key]
  ip_addresses    = [aws_eip.engine[each.key].public_ip]
  subject {
    common_name  = each.key
    organization = var.name_prefix
  }
}

# client_auth as well as server_auth: the container's health probe (site_engine/healthcheck.py)
# presents the engine's own certificate to the engine, whose client CA is this same CA.
resource "tls_locally_signed_cert" "engine" {
  for_each              = local.instances
  cert_request_pem      = tls_cert_request.engine[each.key].cert_request_pem
  ca_private_key_pem    = var.tls_ca_private_key_pem
  ca_cert_pem           = var.tls_ca_cert_pem
  validity_period_hours = var.tls_validity_days * 24
  early_renewal_hours   = 30 * 24
  allowed_uses          = ["digital_signature", "key_agreement", "server_auth", "client_auth"]
}

resource "aws_secretsmanager_secret" "bundle" {
  #checkov:skip=CKV2_AWS_57:The bundle holds TLS material that Terraform re-issues (early_renewal_hours) and an externally issued Hugging Face token; a rotation Lambda could renew neither.
  for_each                = local.instances
  region                  = var.region
  name                    = "${var.name_prefix}/sites/${each.key}/bundle"
  description             = "TLS server certificate and key of fedllm engine ${each.key}, the CA, and the Hugging Face token"
  kms_key_id              = module.kms.arn
  recovery_window_in_days = 7
  tags                    = var.tags
}

resource "aws_secretsmanager_secret_version" "bundle" {
  for_each  = local.instances
  region    = var.region
  secret_id = aws_secretsmanager_secret.bundle[each.key].id
  secret_string = jsonencode({
    ca_pem   = var.tls_ca_cert_pem
    cert_pem = tls_locally_signed_cert.engine[each.key].cert_pem
    key_pem  = tls_private_key.engine[each.key].private_key_pem
    hf_token = var.hf_token
  })
}

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "engine" {
  for_each           = local.instances
  name_prefix        = "${substr("${var.name_prefix}-${each.key}", 0, 30)}-"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
  tags               = var.tags
}

# Each instance reads its own bundle and nothing else.
data "aws_iam_policy_document" "read_bundle" {
  for_each = local.instances
  statement {
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.bundle[each.key].arn]
  }
  statement {
    actions   = ["kms:Decrypt"]
    resources = [module.kms.arn]
  }
}

resource "aws_iam_role_policy" "read_bundle" {
  for_each = local.instances
  name     = "read-own-bundle"
  role     = aws_iam_role.engine[each.key].id
  policy   = data.aws_iam_policy_document.read_bundle[each.key].json
}

# Operators reach the hosts through Session Manager, not SSH: no inbound port for it.
resource "aws_iam_role_policy_attachment" "session_manager" {
  for_each   = local.instances
  role       = aws_iam_role.engine[each.key].name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "engine" {
  for_each    = local.instances
  name_prefix = "${substr("${var.name_prefix}-${each.key}", 0, 30)}-"
  role        = aws_iam_role.engine[each.key].name
  tags        = var.tags
}

module "boot" {
  source        = "../site_boot"
  for_each      = local.instances
  instance_name = each.key
  model         = var.model
  image         = var.image
  grpc_port     = var.grpc_port
  settings      = var.settings
  fetch_bundle  = "  aws secretsmanager get-secret-value --region '${var.region}' --secret-id '${aws_secretsmanager_secret.bundle[each.key].arn}' --query SecretString --output text"
}

resource "aws_instance" "engine" {
  #checkov:skip=CKV_AWS_88:The gateway reaches sites in every cloud over the internet; the security group admits only the gateway's NAT addresses on the gRPC port, and the traffic is mutually authenticated TLS.
  for_each                    = local.instances
  region                      = var.region
  ami                         = data.aws_ssm_parameter.ami.value
  instance_type               = var.instance_type
  availability_zone           = local.zone
  subnet_id                   = module.network.public_subnet_ids[0]
  vpc_security_group_ids      = [aws_security_group.site.id]
  iam_instance_profile        = aws_iam_instance_profile.engine[each.key].name
  user_data                   = module.boot[each.key].script
  user_data_replace_on_change = true
  monitoring                  = true
  ebs_optimized               = true
  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
    # 1: the containers cannot reach the instance's credentials, only the host can.
    http_put_response_hop_limit = 1
  }
  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.disk_gb
    encrypted             = true
    kms_key_id            = module.kms.arn
    delete_on_termination = true
  }
  tags = merge(var.tags, { Name = "${var.name_prefix}-${each.key}", "fedllm:site" = var.name })
  lifecycle {
    # A newer AMI behind the SSM parameter must not replace running engines on the next apply.
    ignore_changes = [ami]
  }
}

resource "aws_eip_association" "engine" {
  for_each      = local.instances
  region        = var.region
  allocation_id = aws_eip.engine[each.key].id
  instance_id   = aws_instance.engine[each.key].id
}
