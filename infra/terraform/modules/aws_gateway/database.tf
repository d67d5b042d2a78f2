# The gateway's PostgreSQL: private subnets, encrypted, TLS enforced, backed up, Multi-AZ by
# default. The gateway migrates it at start-up (GATEWAY_AUTO_MIGRATE).

resource "random_password" "database" {
  length  = 40
  special = false
}

resource "aws_db_subnet_group" "gateway" {
  region     = var.region
  name       = local.name
  subnet_ids = var.private_subnet_ids
  tags       = var.tags
}

resource "aws_db_parameter_group" "gateway" {
  region      = var.region
  name_prefix = "${local.name}-"
  family      = "postgres${split(".", var.database.engine_version)[0]}"
  description = "fedllm gateway: TLS only, connection and slow-query logging"
  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "log_connections"
    value = "1"
  }
  parameter {
    name  = "log_disconnections"
    value = "1"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
  tags = var.tags
  lifecycle {
    create_before_destroy = true
  }
}

data "aws_iam_policy_document" "rds_monitoring_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["monitoring.rds.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "rds_monitoring" {
  name_prefix        = "${local.name}-rds-mon-"
  assume_role_policy = data.aws_iam_policy_document.rds_monitoring_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "rds_monitoring" {
  role       = aws_iam_role.rds_monitoring.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_instance" "gateway" {
  #checkov:skip=CKV_AWS_157:Multi-AZ is on unless var.database.multi_az turns it off (the root's default is true); checkov cannot evaluate optional() defaults of object variables.
  #checkov:skip=CKV_AWS_133:Backups are kept var.database.backup_retention_days days, which the root's validation holds between 1 and 35 (default 14); checkov cannot evaluate optional() defaults of object variables.
  #checkov:skip=CKV2_AWS_30:Statement logging would copy prompts and completions (bind parameters of the request log) into CloudWatch; slow statements and connections are logged instead.
  region                                = var.region
  identifier                            = local.name
  engine                                = "postgres"
  engine_version                        = var.database.engine_version
  instance_class                        = var.database.instance_class
  allocated_storage                     = var.database.allocated_storage_gb
  max_allocated_storage                 = var.database.max_storage_gb
  storage_type                          = "gp3"
  storage_encrypted                     = true
  kms_key_id                            = var.kms_key_arn
  db_name                               = local.database_name
  username                              = local.database_user
  password                              = random_password.database.result
  db_subnet_group_name                  = aws_db_subnet_group.gateway.name
  vpc_security_group_ids                = [aws_security_group.database.id]
  parameter_group_name                  = aws_db_parameter_group.gateway.name
  publicly_accessible                   = false
  multi_az                              = var.database.multi_az
  backup_retention_period               = var.database.backup_retention_days
  deletion_protection                   = true
  skip_final_snapshot                   = false
  final_snapshot_identifier             = "${local.name}-final"
  copy_tags_to_snapshot                 = true
  auto_minor_version_upgrade            = true
  iam_database_authentication_enabled   = true
  enabled_cloudwatch_logs_exports       = ["postgresql", "upgrade"]
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = var.kms_key_arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 60
  monitoring_role_arn                   = aws_iam_role.rds_monitoring.arn
  apply_immediately                     = false
  tags                                  = var.tags
}
